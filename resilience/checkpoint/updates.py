"""The moment just before an optimizer changes the parameters, for the parts of the pack that must act there.

Some must hold the update back: a save whose copy of the state is still running, or a survivor save copying the
live tensors. The place is not always where ``optimizer.step`` begins: a step given a closure (Lightning always
passes one; L-BFGS needs one) runs the forward and the backward inside it, and changes the parameters only once the
closure returns. Holding back at the step's start would then also hold back the forward and backward, which leave
the state alone and should overlap the copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle


def before_update(run: Callable[[], None], *, active: Callable[[], bool] | None = None) -> RemovableHandle:
    """Call ``run`` before every optimizer's update (a global hook; remove it through the handle, never from inside
    a hook, while torch walks its hook table): after the step's closure if it has one, else as the step begins.

    ``active``: when it says False as a step begins, that step is left as it is (no closure is wrapped).
    """

    def hook(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if active is not None and not active():
            return None
        # args are step()'s own: (optimizer, closure?)
        closure = kwargs["closure"] if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if closure is None:
            run()
            return None

        def closure_then_run() -> Any:
            result = closure()
            run()
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_run}
        return (args[0], closure_then_run, *args[2:]), kwargs

    return register_optimizer_step_pre_hook(hook)
