"""An exhaustive model check of the call protocol (docs/verification.md).

The world is abstract and small: a log of intents (state, fence, owner, lease, deadline,
next check, attempts, unknown count), 1-3 workers that run the protocol's steps as
`poimen._engine.protocol` writes them (`_steps`), a provider with requests in flight, and a discrete
clock (`_world`). Every decision is taken by the project's own pure rules
(`poimen._core.decide.decide`, `claimability`, `takeover_deadline`, `attempt_deadline`,
`failure_is_final`), imported, never copied.

At every step anything may happen that the real world allows (`_system`): a worker crashes
(its commits in flight land or not, its requests stay in the network), a renewal does not
come (the lease runs out under a live owner), a commit is slow (up to `commit_delay` ticks) or
its reply is lost, a request lands, is refused or is lost, a reply or a lookup answer is lost,
a thread is slow between any two of its steps. A breadth-first search (`_explore`) visits
every state reachable in a configuration; a violated property prints as the shortest trace.

The rules added since (issue 20) are checked by focused models, each a smaller world of its
own searched the same way (`_focus`): approval vs expiry vs recovery (`_approvals`), the key
window with back-off (`_keywindow`), undo vs prune (`_undoprune`), and a spill vs a settle and
the readers of a history (`_spill`).

    python -m verification.model --workers 2 --intents queryable,unsafe
    python -m verification.model --model undo
"""

from verification.model._approvals import ApprovalConfig
from verification.model._cli import configs, focused, main
from verification.model._explore import Result, explore, replay
from verification.model._keywindow import KeyWindowConfig
from verification.model._spill import SpillConfig
from verification.model._system import Model
from verification.model._undoprune import UndoPruneConfig
from verification.model._world import OLD_RULES, Config, Rules

__all__ = [
    "OLD_RULES",
    "ApprovalConfig",
    "Config",
    "KeyWindowConfig",
    "Model",
    "Result",
    "Rules",
    "SpillConfig",
    "UndoPruneConfig",
    "configs",
    "explore",
    "focused",
    "main",
    "replay",
]
