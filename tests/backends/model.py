"""Holding a backend against the in-memory model, as the backends' tests all do."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from aiolease.testing import BackendFactory
from aiolease.testing.model import make_model_machine

__all__ = ["agrees_with_the_model"]


def agrees_with_the_model(
    factory: BackendFactory,
    loop: str,
    examples: int,
    steps: int,
    *,
    grants_on_release: bool = False,
) -> None:
    """Run the model's state machine on ``factory``'s backends under ``loop``.

    :param examples: hypothesis's ``max_examples``
    :param steps: its ``stateful_step_count``
    :param grants_on_release: the backend's release grants the queue entries that fit
    """
    run_state_machine_as_test(
        make_model_machine(factory, anyio_backend=loop, grants_on_release=grants_on_release),
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
