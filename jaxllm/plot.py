"""Loss curve of a run: ``python -m jaxllm.plot WORKDIR [--output FILE.png]``.

Reads ``WORKDIR/metrics.jsonl`` (see :class:`jaxllm.runtime.metrics.MetricsLogger`) and draws the
training loss and the validation loss (nats/token) against the step, with the validation
split's unigram entropy (the best context-free model's loss, logged with each evaluation)
as a horizontal line.  A resumed run appends to the file; where a step was logged twice
(a run killed after its last checkpoint repeats those steps) the later record wins.
Prints the last validation loss and its margin below the unigram entropy.

Exit codes: 0 written; 2 no metrics file, or it has no training records; 130 Ctrl-C, 143 SIGTERM (nothing
written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxllm import cli


class PlotError(ValueError):
    """The metrics file is missing, malformed or empty; the message names the file and the fix."""


def read_metrics(workdir: str) -> dict[str, dict[int, dict]]:
    """``{"train": {step: record}, "eval": {step: record}}`` from ``WORKDIR/metrics.jsonl``.

    Raises:
      PlotError: the file is missing, a line is not a JSON object with ``step`` and ``kind``,
        or there are no training records.
    """
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise PlotError(f"{path}: not found; WORKDIR must be a training run's --workdir (python -m jaxllm.train "
                        f"writes metrics.jsonl there)")
    runs = {"train": {}, "eval": {}}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                runs[record["kind"]][int(record["step"])] = record
            except (ValueError, KeyError, TypeError):
                raise PlotError(f"{path}:{n}: not a metrics record ({line.strip()[:60]!r}); the file is damaged: "
                                f"remove the line") from None
    if not runs["train"]:
        raise PlotError(f"{path}: no training records yet; plot after the first train.log_interval steps")
    return runs


def summary(runs) -> str:
    """One line: the last validation loss and how far below (or above) the unigram entropy it is (if logged)."""
    evals = [r for _, r in sorted(runs["eval"].items()) if r.get("eval_loss") is not None]
    if not evals:
        step, r = max(runs["train"].items())
        return f"step {step}: training loss {r['loss']:.4f} nats/token (no evaluation logged)"
    r = evals[-1]
    line = f"step {r['step']}: validation loss {r['eval_loss']:.4f} nats/token"
    if r.get("unigram_entropy") is not None:
        h = r["unigram_entropy"]
        margin = h - r["eval_loss"]
        line += f", unigram entropy of the validation split {h:.4f}: " + (
            f"{margin:.4f} nats below it" if margin >= 0 else
            f"{-margin:.4f} nats above it (not yet better than predicting tokens by their frequency alone)")
    return line


def plot(runs, output: str, title: str = "") -> None:
    """Writes the loss curve PNG to ``output`` (directories created)."""
    import matplotlib  # noqa: PLC0415  (a CLI dependency only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    train = sorted((s, r["loss"]) for s, r in runs["train"].items() if r.get("loss") is not None)
    evals = sorted((s, r) for s, r in runs["eval"].items() if r.get("eval_loss") is not None)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(*zip(*train), label="training loss (the logged step's batch)", lw=1.2)
    if evals:
        ax.plot([s for s, _ in evals], [r["eval_loss"] for _, r in evals], "o-", label="validation loss", ms=4)
        h = evals[-1][1].get("unigram_entropy")
        if h is not None:
            ax.axhline(h, color="grey", ls="--", lw=1, label=f"unigram entropy of the validation split ({h:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = f"{output}.tmp-{os.getpid()}.png"  # a complete file or none: written aside, then renamed
    try:
        fig.savefig(tmp)
        os.replace(tmp, output)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


@cli.stoppable("jaxllm.plot")
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxllm.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("workdir", help="a training run's --workdir (holds metrics.jsonl)")
    p.add_argument("--output", help="PNG path (default: WORKDIR/loss.png)")
    p.add_argument("--title", default=None, help="plot title (default: WORKDIR)")
    args = p.parse_args(argv)
    try:
        runs = read_metrics(args.workdir)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    output = args.output or os.path.join(args.workdir, "loss.png")
    try:
        plot(runs, output, args.workdir if args.title is None else args.title)
    except OSError as e:
        print(f"error: cannot write {output} ({e.strerror}); give --output=FILE in a directory you can write",
              file=sys.stderr)
        return 2
    print(summary(runs))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
