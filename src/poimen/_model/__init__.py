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

    python -m poimen._model --workers 2 --intents queryable,unsafe
"""

from poimen._model._cli import configs, main
from poimen._model._explore import Result, explore, replay
from poimen._model._system import Model
from poimen._model._world import OLD_RULES, Config, Rules

__all__ = [
    "OLD_RULES",
    "Config",
    "Model",
    "Result",
    "Rules",
    "configs",
    "explore",
    "main",
    "replay",
]
