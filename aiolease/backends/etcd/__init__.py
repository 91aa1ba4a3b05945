"""The etcd v3 backend: one session lease, FIFO by revision, revision fencing, watches.

URLs::

    etcd://[user[:password]@]host[:port][,host[:port]...][?option=value&...]

Several endpoints give fail-over between the members of a cluster. Options, in the
query or as keyword arguments: ``prefix`` (default ``aiolease/``), ``fair``
(``1``/``0``), ``timeout`` (seconds per request, default 5), ``session_idle``
(seconds an unused session lease is kept, default 30), and for TLS ``tls``,
``ca_file``, ``cert_file``, ``key_file``. An ``aetcd.Client`` the application already
has is used as it is, and never closed by the backend::

    backend = EtcdBackend(aetcd.Client("10.0.0.5", 2379), prefix="myapp/locks/", fair=True)

It follows etcd's own Go ``concurrency`` package:

* **One session lease per backend object and ttl**, kept alive by the backend's own
  task every third of its TTL. Every lease held through the backend rides on it, so
  holding N leases costs one keepalive per tick. The core does not renew the leases
  it holds (:meth:`EtcdBackend.hold`): their deadlines follow the session's
  confirmed keepalives. When the session is lost, every
  lease on it ends at once, with its reason; later acquisitions get a new session.
* **Acquire** is one transaction: if the name has no key, put the owner's key
  (``<prefix><name>/<owner>``) on the session lease; else read the first one. The
  token is the key's create revision, which only grows (also across restarts).
  A retry after a lost reply finds its own key and never adds a second one. In
  non-fair mode the key is ``<prefix><name>/<slot>`` instead, a slot of the backend
  object's that it reuses once the key is deleted, and the value names the owner:
  etcd keeps deleted keys in its index until it compacts, and every acquire ranges
  over the name's keys.
* **Permits** (semaphores, read-write locks) have keys of their own under
  ``<prefix>%permits/<name>/``: a request's permit key, or its queue key while it
  waits, in a slot of the backend object (``permit:<random>.<n>``, in either mode)
  that it reuses once it has seen the keys deleted; the value names the owner.
* **Fair mode** queues a waiter's key under the name and watches only the key
  created just before it, as etcd's Mutex does; the holder is always the key with
  the lowest create revision.
* **Wake-ups** are watches: a waiter, an observer or a holder's takeover watch
  learns of a release or expiry as soon as etcd deletes the key.
* **TTLs.** etcd grants whole seconds and at least its minimum (``3/2 x election
  timeout``, rounded up: 2 s with the default 1 s election timeout). A lease's local
  deadline comes from the smaller of the ttl asked for and the TTL granted, counted
  from the send time of the last confirmed keepalive. A grant nobody holds or renews
  has its key deleted by the backend once its own ttl passes, and if the process dies, etcd
  deletes it when the session's TTL runs out: after at least the minimum.
* Release deletes the key; closing the backend revokes its session leases.
"""

from ._backend import EtcdBackend
from ._stats import EtcdStatistics

__all__ = ["EtcdBackend", "EtcdStatistics"]
