"""The ZooKeeper backend: ephemeral sequential nodes of one session, lowest holds.

URLs::

    zookeeper://host[:port][,host[:port]...][/chroot][?option=value&...]

(``zk://`` is the same.) Options, in the query or as keyword arguments: ``prefix``
(the node under the chroot that holds the leases, default ``aiolease``),
``session_timeout`` (seconds, default 10; the server clamps it) and ``timeout``
(seconds one request may take, default 5). An ``aiozk.ZKClient`` the application
already has is used as it is, and never closed by the backend::

    backend = ZooKeeperBackend(aiozk.ZKClient("zk1:2181,zk2:2181"), prefix="myapp/locks")

How it works (see ``docs/internals/zookeeper.md``):

* **Session = lease.** The backend's one ZooKeeper session carries every lease it
  holds: holding N leases costs the session's pings, nothing per lease. The core
  does not renew them (:meth:`ZooKeeperBackend.hold`); their local deadlines follow
  the session clock, counted here from the send time of the last request the server
  answered plus the negotiated session timeout, whatever the client library
  believes. Past it, every lease of the session is lost; replies on a new session
  mean the server expired the old one, and its leases are lost too.
* **A lease's ttl** bounds a grant nobody holds (the backend deletes its node once
  the ttl passes unrenewed) and never exceeds the session timeout; a held lease
  lives as long as the session, and a crashed holder's name is free once ZooKeeper
  expires its session: after the negotiated session timeout.
* **Recipe** (kazoo's Lock, Curator's InterProcessMutex): an ephemeral sequential
  node ``_c_<owner>-lock-<n>`` under the name's node; the lowest holds; a waiter
  watches only the node just before its own. The owner id in the node's name finds
  a node whose create reply was lost; only nodes of the backend's own session
  (``ephemeralOwner``) are taken for its own.
* **Token**: the node's ``czxid``, which only grows over the ensemble's life.
* **Permits** (semaphores, read-write locks): an ephemeral sequential node per
  request under ``<name>%permits``, its limit and weight in its name; granted iff the
  weights of the nodes before it and its own fit in the limit (first come, first
  served); its token the zxid of the write that marked it held.
"""

from ._backend import ZooKeeperBackend
from ._stats import ZooKeeperStatistics

__all__ = ["ZooKeeperBackend", "ZooKeeperStatistics"]
