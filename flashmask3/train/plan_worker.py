"""The planning worker of the training loader (``loader.ProcessPlanner``): a plain Python
process (``python -m flashmask3.train.plan_worker``) that reads pickled ``plan()`` requests on
stdin and writes the pickled plans, or the exception a request raised, on stdout.

A separate interpreter plans without the training process's GIL. It is started as a module of
its own rather than through ``multiprocessing``: spawn would re-import the user's main script
in the worker, which an unguarded script (no ``if __name__ == "__main__":``) turns into a second
training run, possibly joining the process group. The worker imports nothing but
``flashmask3.distributed`` and never touches a GPU.
"""

from __future__ import annotations

import pickle
import sys


def serve(inp, out) -> None:
    """Answer requests ``(cols, causal, cp, kwargs)`` from ``inp`` with ``(True, plan)`` or
    ``(False, exception)`` on ``out`` until ``inp`` ends."""
    from flashmask3.distributed import plan

    while True:
        try:
            cols, causal, cp, kwargs = pickle.load(inp)
        except EOFError:
            return
        try:
            reply = (True, plan(cols, causal, cp, **kwargs))
        except Exception as exc:  # noqa: BLE001 - handed to the training process, which raises it
            reply = (False, exc)
        pickle.dump(reply, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()


def main() -> int:
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed by an import goes to stderr, not into the replies
    serve(sys.stdin.buffer, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
