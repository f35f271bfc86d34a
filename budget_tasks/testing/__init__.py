"""For testing code that uses budget-tasks: the fake provider, a manual clock, and the
pytest plugin (:mod:`.pytest_plugin`, loaded by pytest on its own: fixtures
``budget_ledger``, ``fake_llm``, ``budget_eager``).

budget-tasks' own harness (worker processes, the fault proxy, races) is apart, in
:mod:`budget_tasks.testing.harness`, and is not part of this API.
"""

from .clock import ManualClock
from .fake_billing import Realism
from .fake_provider import FakeProvider

__all__ = ["FakeProvider", "ManualClock", "Realism"]
