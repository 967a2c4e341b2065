"""A diffusers ``DDPMPipeline`` whose 8-bit images have exact channel totals.

``hardeq.diffusion.ConstrainedScheduler`` wraps a diffusers ``DDPMScheduler`` and conditions its
x0-predictions on per-image, per-channel pixel sums (``channel_sum_constraint``); with ``final="box"``
its last step returns the most probable point of the last step's Gaussian given the sums **and** the pixel box
``[-1, 1]`` (its mode, an exact projection), so the pipeline's closing ``(x / 2 + 0.5).clamp(0, 1)`` changes
nothing and the returned images keep the totals. (``final="sample_box"`` draws a *sample* of that law instead,
by exact HMC when the box cuts deep into it; with this untrained network the last step's Gaussian sits far
outside the box and the sampler's trajectories bounce off its walls too often, so the example uses the mode.)
``hardeq.diffusion.to_uint8_exact`` then rounds to 8 bits by largest remainder, keeping every channel's integer
sum equal to ``round(255 * total)``.

The network is a tiny, randomly initialised ``UNet2DModel`` (the images are noise-like; what is shown is the
constraint, not image quality). The script runs the same pipeline three ways from the same seed and prints each
one's worst channel-total error:

* the scheduler conditioned without the box (``final=None``): exact before the pipeline's clamp, broken after it
  (claim, the contrast: it misses a total by more than 1e-2);
* ``final="box"``: exact in float (claim: ``|sum - k| <= 1e-5 * pixels`` in [0, 1] units, float32), every pixel
  in [0, 1];
* the 8-bit images of the latter from ``to_uint8_exact`` (claim: every channel's integer sum equals
  ``round(255 k)`` exactly, and no pixel moves by a grey level or more).

The script exits with status 1, naming the claims that failed, when one does not hold.

Run: ``python examples/diffusers_pipeline.py [--out DIR] [--seed S]``; needs the ``diffusion`` extra
(``pip install -e ".[diffusion]"``: diffusers) and matplotlib.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hardeq.diffusion import ConstrainedScheduler, channel_sum_constraint, to_uint8_exact

DEFAULT_OUT = Path(__file__).resolve().parent / "figures"


def claims(r: dict[str, float]) -> list[tuple[str, bool]]:
    """Each claim the script prints, with whether the numbers ``r`` (what :func:`main` returns) meet it (a NaN
    meets none)."""
    return [
        (f"final=None misses the totals once the pipeline clamps (by {r['err_plain']:.3f} > 1e-2)",
         r["err_plain"] > 1e-2),
        (f"final='box' meets every channel total: max error {r['err_boxed']:.2e} <= {r['tol']:.1e}",
         r["err_boxed"] <= r["tol"]),
        (f"final='box' keeps every pixel in [0, 1] (got [{r['min_pixel']:.3f}, {r['max_pixel']:.3f}])",
         0 <= r["min_pixel"] and r["max_pixel"] <= 1),
        (f"to_uint8_exact meets every integer total round(255 k) exactly (max error {r['err_u8']:g} grey levels)",
         r["err_u8"] == 0),
        (f"to_uint8_exact moves no pixel by a grey level or more (largest change {r['level_gap']:.2f})",
         r["level_gap"] < 1),
    ]


def enforce(checked: list[tuple[str, bool]]) -> None:
    """Print that every claim holds, or exit with status 1 and the claims that fail (running the script is a
    check: a claim that does not hold is an error, never just a printed number)."""
    failed = [claim for claim, ok in checked if not ok]
    if failed:
        raise SystemExit(f"{Path(__file__).name}: {len(failed)} of {len(checked)} claims failed:\n"
                         + "\n".join(f"  - {claim}" for claim in failed))
    print(f"all {len(checked)} claims hold")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the figure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (these models are tiny: one is fastest, and a busy machine's "
                             "cores are not oversubscribed)")
    parser.add_argument("--steps", type=int, default=25, help="DDPM inference steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import diffusers

    torch.manual_seed(args.seed)
    batch, channels, size = 4, 3, 8
    m = size * size
    unet = diffusers.UNet2DModel(
        sample_size=size, in_channels=channels, out_channels=channels, block_out_channels=(16, 32),
        layers_per_block=1, norm_num_groups=8, down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D")).eval()
    # per-channel totals in the model's space [-1, 1] (one per channel, shared by the images); in the
    # pipeline's [0, 1] units a channel's total is (k + m) / 2: mean brightness 0.375, 0.5 and 0.625
    totals = torch.tensor([-0.25 * m, 0.0, 0.25 * m])
    totals01 = ((totals + m) / 2).double()
    shape = (batch, channels, size, size)
    base = diffusers.DDPMScheduler(num_train_timesteps=1000, clip_sample=False)

    def run(final: str | None) -> torch.Tensor:
        cs = ConstrainedScheduler(base, channel_sum_constraint(shape, totals), final=final)
        pipe = diffusers.DDPMPipeline(unet, cs)
        pipe.set_progress_bar_config(disable=True)
        out = pipe(batch_size=batch, generator=torch.Generator().manual_seed(args.seed),
                   num_inference_steps=args.steps, output_type="np").images          # (B, H, W, C) in [0, 1]
        return torch.from_numpy(out.copy()).permute(0, 3, 1, 2).double()

    plain = run(None)
    boxed = run("box")
    err_plain = float((plain.sum((-2, -1)) - totals01).abs().max())
    err_boxed = float((boxed.sum((-2, -1)) - totals01).abs().max())
    u8 = to_uint8_exact(boxed, totals01)
    target = torch.round(255 * totals01).to(torch.int64)
    err_u8 = int((u8.sum((-2, -1), dtype=torch.int64) - target).abs().max())
    level_gap = float((u8.double() - 255 * boxed).abs().max())
    tol = 1e-5 * m
    print(f"{batch} images {channels} x {size} x {size}, {args.steps} DDPM steps, channel totals in [0, 1] units "
          f"{totals01.tolist()}")
    print(f"conditioned, final=None (clamped by the pipeline): max |channel sum - total| = {err_plain:.3f} "
          "(claim, the contrast: > 1e-2)")
    print(f"conditioned, final='box': max |channel sum - total| = {err_boxed:.2e} (claim: <= {tol:.1e}); "
          f"pixels in [{float(boxed.min()):.3f}, {float(boxed.max()):.3f}] (claim: in [0, 1])")
    print(f"8-bit, to_uint8_exact: max |integer channel sum - round(255 total)| = {err_u8} grey levels (claim: 0); "
          f"largest pixel change {level_gap:.2f} grey levels (claim: < 1)")

    args.out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, batch, figsize=(2.2 * batch, 4.6))
    for i in range(batch):
        axes[0, i].imshow(plain[i].permute(1, 2, 0).numpy(), interpolation="nearest")
        axes[0, i].set_title(f"final=None\nmiss {float((plain[i].sum((-2, -1)) - totals01).abs().max()):.2f}",
                             fontsize=8)
        axes[1, i].imshow(u8[i].permute(1, 2, 0).numpy(), interpolation="nearest")
        axes[1, i].set_title(f"final=box, uint8\nsums {u8[i].sum((-2, -1), dtype=torch.int64).tolist()}", fontsize=8)
        for ax in axes[:, i]:
            ax.axis("off")
    fig.suptitle(f"8-bit targets round(255 k) = {target.tolist()}", fontsize=9)
    fig.tight_layout()
    path = args.out / "diffusers_pipeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"figure: {path}")
    numbers = {"err_plain": err_plain, "err_boxed": err_boxed, "tol": tol, "err_u8": float(err_u8),
               "level_gap": level_gap, "min_pixel": float(boxed.min()), "max_pixel": float(boxed.max())}
    enforce(claims(numbers))
    return numbers


if __name__ == "__main__":
    main()
