"""One rank of the in-place commit world (test_commit_in_place.py), run with RINGSERVE_COMMIT_IN_PLACE=1.

    in_place.py OUT_DIR

Writes OUT_DIR/rank{r}.json with what the test checks:

- ``kept``: after a commit, which saved tensors are the live ones (the trained parameters and the
  optimizer's state) and which are copies (the batch norm's buffers);
- ``second_step``: the error of a second optimizer step with no commit since the last one;
- ``intact``: a restore with nothing changed since the commit (a backward pass, no step): the
  commit count after it, and whether the rank dropped its commit;
- ``one_moved``: the last rank changes a trained parameter in place after a commit, then every
  rank restores, syncs, and takes a step and a commit: whether each dropped its commit at the
  restore, its commit count after that step (one past the commit), and whether it still counts
  as dropped;
- ``all_moved``: every rank takes one more step after a commit, then restores and syncs: the
  error of the sync (no rank holds the commit, and no checkpoint exists); ``guard_after_drop``:
  the optimizer's count of the commit held in place, after that restore (none);
- ``sha``: the parameters' digest after ``one_moved`` (every rank alike: the change is gone).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

import ringserve.torch as hvd
from ringserve.errors import StateLostError, UsageError
from ringserve.torch import elastic


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for tensor in model.parameters():  # the buffers (batch norm's statistics) are each rank's own
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    out_dir = Path(sys.argv[1])
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())  # different everywhere: the first sync makes them equal
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
    state: Any = elastic.TorchState(model=model, optimizer=opt, step=0)
    state.sync()
    last = hvd.rank() == hvd.size() - 1
    out: dict[str, Any] = {}

    def backward(step: int) -> None:
        g = torch.Generator().manual_seed(step * 31 + hvd.rank())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(8, 16, generator=g)),
                                          torch.randint(0, 4, (8,), generator=g)).backward()

    for _ in range(3):
        backward(state.step)
        opt.step()
        state.step += 1
        state.commit()
    saved = state._model_saved
    out["kept"] = {
        "weight": saved["0.weight"].data_ptr() == model[0].weight.data_ptr(),
        "bias": saved["3.bias"].data_ptr() == model[3].bias.data_ptr(),
        "running_mean": saved["1.running_mean"].data_ptr() == model[1].running_mean.data_ptr(),
        "exp_avg": all(s["exp_avg"].data_ptr() == opt.state[p]["exp_avg"].data_ptr()
                       for s, p in zip(state._optimizer_saved["state"].values(), model.parameters(), strict=True)),
    }

    # A second step with no commit in between refuses to run. Its backward pass had started the
    # gradients' reductions; synchronize() below lets them end on every rank alike.
    backward(state.step)
    opt.step()
    backward(state.step + 1)
    try:
        opt.step()
        out["second_step"] = None
    except UsageError as exc:
        out["second_step"] = str(exc)
    opt.synchronize()  # the refused step's reductions
    state.step += 1
    state.commit()

    # Nothing changed since the commit but a backward pass: the restore finds the commit intact.
    commits = state.commits
    backward(state.step)
    opt.synchronize()
    state.restore()
    out["intact"] = {"commits": state.commits, "before": commits, "dropped": state.dropped}
    state.sync()

    # One rank changes a trained parameter in place after the commit: its restore drops the
    # commit, and the sync gives it the others'.
    backward(state.step)
    opt.step()
    state.step += 1
    state.commit()
    commits = state.commits
    if last:
        with torch.no_grad():
            model[0].weight.add_(1.0)
    state.restore()
    dropped = state.dropped
    state.sync()
    # The moved rank heals (its state comes point to point while its first step sends zeros):
    # it holds the commit once that step is in.
    backward(state.step)
    opt.step()
    state.step += 1
    state.commit()
    out["one_moved"] = {"dropped": dropped, "commits": state.commits, "before": commits, "dropped_after": state.dropped}
    out["sha"] = digest(model)

    # Every rank steps past the commit: none holds it, and the sync says so by name.
    backward(state.step)
    opt.step()
    state.restore()
    # Dropped, it holds no commit in place: its next step (a healing one, say) is no second step.
    out["guard_after_drop"] = opt.committed_in_place_at
    try:
        state.sync()
        out["all_moved"] = None
    except StateLostError as exc:
        out["all_moved"] = f"{type(exc).__name__}: {exc}"
    (out_dir / f"rank{hvd.rank()}.json").write_text(json.dumps(out))
    hvd.shutdown()


if __name__ == "__main__":
    main()
