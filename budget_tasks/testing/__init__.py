"""For testing code that uses budget-tasks: the fake provider, a manual clock, and the
pytest plugin (:mod:`.pytest_plugin`, loaded by pytest on its own: fixtures
``budget_ledger``, ``fake_llm``, ``budget_eager``).

budget-tasks' own test harness (worker processes, a fault proxy, races) is not
shipped: it lives in the project's ``tests/support/``.
"""

from .clock import ManualClock
from .fake_billing import Realism
from .fake_provider import FakeProvider

__all__ = ["FakeProvider", "ManualClock", "Realism"]
