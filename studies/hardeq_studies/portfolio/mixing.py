"""How well the long-only variant's truncated mean is estimated: one run's ``ours`` network retrained exactly as
the study trains it, its test windows' truncated laws sampled as the study samples them, and the windows with the
largest split R-hat sampled again with long chains, as a reference.

Run ``python -m hardeq_studies.portfolio.mixing --universe sp500-50 --run 4`` (the ``cpu`` preset's settings; about
a minute on one idle core) from a clean commit. It writes ``results/diagnostics/portfolio-long-only-mixing.md``
(``--out``) with the command, the commit and what it measured. For the worst windows: split R-hat and the
effective sample size of ``chains`` chains of ``per-chain`` draws after 50, 500 and 3000 sweeps, and the distance
between the study's estimate (``draws`` draws after ``burn_in`` sweeps, the config's ``long_only``) and the longest
run's mean, beside that reference's own Monte Carlo standard error. A split R-hat that stays above 1 however long
the burn-in, with the study's estimate within a few reference standard errors, says the chains were past burn-in
but strongly autocorrelated (the study's draws are worth about its smallest effective sample size), not stuck at
their start.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from . import bounds, run

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hardeq_studies.portfolio.mixing", description=__doc__.split("\n\n")[0])
    p.add_argument("--universe", default="sp500-50", help="a universe of the cpu preset (default sp500-50)")
    p.add_argument("--run", type=int, default=4, help="the run whose ours network is retrained (default 4)")
    p.add_argument("--windows", type=int, default=6, help="how many of the worst windows to resample (default 6)")
    p.add_argument("--per-chain", type=int, default=64, help="draws per chain of the long runs (default 64)")
    p.add_argument("--burn-ins", default="50,500,3000", help="burn-in sweeps of the long runs (default 50,500,3000)")
    p.add_argument("--out", type=Path, default=Path("results") / "diagnostics" / "portfolio-long-only-mixing.md",
                   help="the Markdown file written (default results/diagnostics/portfolio-long-only-mixing.md)")
    args = p.parse_args(argv)
    from ..results import atomic_write_text, dirty_refusal, environment

    refusal = dirty_refusal("portfolio-long-only-mixing", "cpu")
    if refusal:
        p.error(refusal)
    t0 = time.perf_counter()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    torch.set_num_threads(1)
    config = json.loads((Path(__file__).parent / "config.json").read_text())
    s = run.settings(config, "cpu")
    data = run.prepare(s, args.universe)
    tensors = {k: w.tensors(torch.float32) for k, w in data.splits.items()}
    captured: dict[str, object] = {}
    study_rule = bounds.long_only_weights

    def capture(head, raw, **kwargs):  # the study's own call, with its arguments recorded
        captured.update(head=head, raw=raw, kwargs=kwargs)
        return study_rule(head, raw, **kwargs)

    bounds.long_only_weights = capture
    try:
        out = run.train_unit(s, data, tensors, "ours", args.run, epochs=int(s["epochs"]), device=torch.device("cpu"))
    finally:
        bounds.long_only_weights = study_rule
    head, raw, kwargs = captured["head"], captured["raw"], captured["kwargs"]
    say(f"{args.universe} run {args.run}: the study's sampler record {out['long_only_sampler']}")
    truncated = head.distribution(raw).truncate(0.0, 1.0)
    from ..truncated_mean import truncated_mean

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(kwargs["seed"]))
        info = truncated.sample_with_info((int(kwargs["draws"]),), chains=int(kwargs["chains"]),
                                          burn_in=int(kwargs["burn_in"]))
    estimate, _ = truncated_mean(truncated, **kwargs)  # the study's estimate (same seed: the same draws)
    worst = info.rhat.nan_to_num(0.0).amax(-1)
    idx = worst.argsort(descending=True)[: args.windows]
    say(f"worst windows {idx.tolist()}, their largest split R-hat in the study: "
          f"{[round(float(x), 2) for x in worst[idx]]}")
    sub = head.distribution(raw[idx]).truncate(0.0, 1.0)
    chains = int(kwargs["chains"])
    reference = se = None
    for burn in (int(b) for b in args.burn_ins.split(",")):
        t = time.perf_counter()
        torch.manual_seed(burn)
        o = sub.sample_with_info((chains * args.per_chain,), chains=chains, burn_in=burn)
        rh = o.rhat.nan_to_num(0.0).amax(-1)
        say(f"burn-in {burn}, {chains} chains x {args.per_chain} draws: {time.perf_counter() - t:.1f} s; largest "
              f"split R-hat per window {[round(float(x), 2) for x in rh]}; smallest ESS {float(o.ess.min()):.1f}")
        reference = o.samples.mean(0)
        se = o.samples.std(0) / o.ess.clamp_min(1.0).sqrt()
    diff = (estimate[idx] - reference).abs()
    say("the study's estimate against the last (longest burn-in) run's mean: largest |difference| per window "
          f"{[round(float(x), 4) for x in diff.amax(-1)]}, "
          f"sum over weights {[round(float(x), 3) for x in diff.sum(-1)]}")
    say(f"that reference's own standard error, largest per window {[round(float(x), 4) for x in se.amax(-1)]}")
    moved = (bounds.clip_then_project(head.distribution(raw[idx]).mean) - estimate[idx]).abs().sum(-1)
    say(f"for scale: sum |truncated mean - clip-then-project| per window {[round(float(x), 3) for x in moved]}")
    env = environment("cpu")
    command = "python -m hardeq_studies.portfolio.mixing " + " ".join(sys.argv[1:] if argv is None else argv)
    text = "\n".join([
        "# Portfolio long-only variant: how well the truncated mean is estimated", "",
        "Written by `studies/hardeq_studies/portfolio/mixing.py` (its docstring says what it does and how to read "
        "it).", "",
        f"Command: `{command.strip()}`; git {str(env.get('git'))[:10]} (dirty: {env.get('dirty')}); torch "
        f"{env['torch']}, {env['threads']} thread(s); {time.perf_counter() - t0:.0f} s.", "",
        *[f"- {line}" for line in lines], ""])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
