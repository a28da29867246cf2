"""`poimen crashtest -- COMMAND`: run an agent once cleanly, then once per tool call and crash
point, SIGKILLed there and restarted, and count at a witness outside the agent what took effect
twice (docs/crash-testing.md).

- `_witness`: the provider stand-in and its ledger.
- `_run`: the supervisor: the clean run, the cases, the kills and restarts.
- `_report`: the table, JSON and JUnit XML.
"""

from poimen.crashtest._report import Case, Double, Report
from poimen.crashtest._run import CrashTestError, Options, crashtest
from poimen.crashtest._witness import Answers, AnswersError, Witness

__all__ = [
    "Answers",
    "AnswersError",
    "Case",
    "CrashTestError",
    "Double",
    "Options",
    "Report",
    "Witness",
    "crashtest",
]
