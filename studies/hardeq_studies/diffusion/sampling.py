r"""The sampled variants of the ``diffusion`` study and the sampling of one chunk of images.

Every variant is a sampling-time change of the same trained denoiser, and every variant of a chunk starts from
the same noise:

* **DDPM group** (paper Table 3): one 1000-step ancestral trajectory per image. Its last step is taken four
  times from the same :math:`x_1`: unconstrained (``DDPM``), conditioned on the constraint (``DDPM + ours``, the
  exact last step of :func:`hardeq.diffusion.ddpm_sample`, computed as a one-step ``ddpm_sample`` with
  ``DDPMOptions(betas=betas[:1])`` and ``noise = x_1``, which is that loop's last step), its conditional mean
  (``deterministic=True``) and the conditional mode in the pixel box (``final="box"``, :func:`~hardeq.diffusion.
  box_project`). The unconstrained output is also repaired after the fact: orthogonal (KKT) projection onto the
  constraint (``+ projection``), and the projection followed by clipping to the pixel range
  (``+ projection + clip``). DDPM's own last step is deterministic (variance 0) and returns :math:`\hat x_0`, and
  the conditional mean of an isotropic Gaussian given :math:`Ax = k` is the orthogonal projection of its mean, so
  ``DDPM + ours (deterministic)`` *equals* ``DDPM + projection`` up to round-off (recorded per image as
  ``diff_to_projection``): that pair decides nothing.
* **DDIM groups** (Tables 4, 6, 7): ``ddim_sample`` with ``eta = 0`` (deterministic DDIM), unconstrained (with
  the same two repairs) or with the :math:`\hat x_0`-prediction conditioned at the steps of a schedule. The
  headline schedule is also run with ``deterministic=True`` (group suffix ``+det``) and with ``final="box"``
  (``+box``: the same conditioned steps, the last one replaced by the mode in the box). The initial noise
  :math:`x_T` of chunk ``j`` is the same for every schedule, and so is the conditioning stream.

A chunk's result keeps, per variant, what the evaluation needs and nothing else: the 8-bit images as a user saves
them (for the box rows :func:`hardeq.diffusion.to_uint8_exact` onto the totals after a float64
:func:`~hardeq.diffusion.box_project` onto the ``[0, 1]`` totals, plain rounding of the clipped image for the
others), the per-image, per-channel constraint residuals of the *unclipped* float output (pixel units of
``[0, 1]``), the residuals of the saved 8-bit images (grey levels, against ``round(255 k)``) and the share of
pixels outside ``[0, 1]``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from .data import from_model, quantize, residuals

__all__ = ["Variant", "parse_schedule", "schedule_label", "ddpm_variants", "ddim_variants", "sample_group",
           "group_of", "split_group", "residuals_u8", "describe_samplers", "GROUP_SUFFIXES"]

#: group suffixes of the headline schedule's extra runs: the conditional mean, and the mode in the box
GROUP_SUFFIXES = ("+det", "+box")

_SCHEDULE = re.compile(r"^\s*(Uniform|StartEnd|StartSpaced|EndSpaced)\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)\s*$")


def parse_schedule(text: str):
    """``"StartEnd(3, 3)"`` (or ``Uniform(4)``, ``StartSpaced(4, 2)``, ``EndSpaced(4, 1)``) as a
    :mod:`hardeq.diffusion` schedule."""
    from hardeq import diffusion

    m = _SCHEDULE.match(text)
    if m is None:
        raise ValueError(f"schedule {text!r}: expected Uniform(n), StartEnd(a, b), StartSpaced(n, s) or "
                         "EndSpaced(n, s).")
    cls = getattr(diffusion, m.group(1))
    args = [int(m.group(2))] + ([int(m.group(3))] if m.group(3) is not None else [])
    return cls(*args)


def schedule_label(text: str) -> str:
    """The paper's name of a schedule, e.g. ``"Start 3 End 3"``."""
    return parse_schedule(text).label


@dataclass(frozen=True)
class Variant:
    """One sampled variant: ``key`` (stable id), ``label`` (printed), ``group`` (the sampling run it comes
    from), ``post`` (a repair of the group's unconstrained output, or the last step's kind: ``"ours"``,
    ``"ours_det"``, ``"box"``, ``"ours_u8"``: the sampled last step saved through the 8-bit exact rounding) and
    ``exact`` (expected to satisfy the constraint to round-off in floating
    point)."""

    key: str
    label: str
    group: str
    post: str | None
    exact: bool


def ddpm_variants() -> list[Variant]:
    return [Variant("ddpm", "DDPM", "ddpm", None, False),
            Variant("ddpm+ours", "DDPM + ours (last step)", "ddpm", "ours", True),
            Variant("ddpm+ours+det", "DDPM + ours (last step, deterministic)", "ddpm", "ours_det", True),
            Variant("ddpm+ours+box", "DDPM + ours + box (last step)", "ddpm", "box", True),
            Variant("ddpm+ours+u8", "DDPM + ours (last step) + to_uint8_exact", "ddpm", "ours_u8", True),
            Variant("ddpm+project", "DDPM + projection", "ddpm", "project", True),
            Variant("ddpm+project+clip", "DDPM + projection + clip", "ddpm", "project_clip", False)]


def ddim_variants(schedules: list[str], num_steps: int, headline: str | None = None) -> list[Variant]:
    """The unconstrained DDIM run, its two repairs, and one conditioned run per schedule (exact when the
    schedule conditions the last of the ``num_steps`` steps); for the ``headline`` schedule also its
    deterministic run and its run with the box-exact last step."""
    out = [Variant("ddim", "DDIM", "ddim", None, False),
           Variant("ddim+project", "DDIM + projection", "ddim", "project", True),
           Variant("ddim+project+clip", "DDIM + projection + clip", "ddim", "project_clip", False)]
    for text in schedules:
        sch = parse_schedule(text)
        key = f"ddim@{sch!r}"
        out.append(Variant(key, f"DDIM + ours ({sch.label})", key, None, sch.includes_last(num_steps)))
    if headline is not None:
        sch = parse_schedule(headline)
        key = f"ddim@{sch!r}"
        out += [Variant(key + "+det", f"DDIM + ours ({sch.label}, deterministic)", key + "+det", "ours_det",
                        sch.includes_last(num_steps)),
                Variant(key + "+box", f"DDIM + ours + box ({sch.label})", key + "+box", "box", True)]
    return out


def group_of(key: str) -> str:
    """The sampling group of a variant key (``"ddpm"``, ``"ddim"`` or ``"ddim@Schedule(...)"``)."""
    if key.startswith("ddpm"):
        return "ddpm"
    if key.startswith("ddim@"):
        return key
    return "ddim"


def split_group(group: str) -> tuple[str, str]:
    """A DDIM schedule group ``"ddim@Schedule(...)[+det|+box]"`` as ``(schedule text, suffix)``."""
    body = group[len("ddim@"):]
    for suffix in GROUP_SUFFIXES:
        if body.endswith(suffix):
            return body[:-len(suffix)], suffix
    return body, ""


def residuals_u8(images: Tensor, totals: Tensor) -> Tensor:
    """``|sum_c u - round(255 k_c)|`` per image and channel in grey levels, ``(N, C)`` float64: the error of the
    saved 8-bit images ``u`` against the nearest integer total an 8-bit image can have (0 = exact as saved)."""
    target = (255 * totals.to(torch.float64)).round()
    return (images.to(torch.int64).sum((-2, -1)).to(torch.float64) - target).abs()


def _summary(y: Tensor, totals: Tensor, *, box: bool = False) -> dict[str, Tensor]:
    """What the evaluation keeps of the float output ``y`` ``(n, C, H, W)`` in ``[-1, 1]`` of a variant:
    ``images`` (uint8, as saved: :func:`~hardeq.diffusion.to_uint8_exact` onto ``totals`` for a box-exact row,
    else clipped and rounded), ``residual`` (float, unclipped), ``residual_u8`` (of the saved images) and
    ``out_of_range`` (share of pixels outside ``[0, 1]``)."""
    from hardeq.diffusion import box_project, to_uint8_exact

    x01 = from_model(y.detach().to(torch.float64))
    if box:  # the documented pipeline: float64 box projection onto the [0, 1] totals (moves pixels by round-off
        # of the float32 output only), so the integer totals round(255 k) are always reachable, then 8 bits
        k = totals.to(device=x01.device, dtype=torch.float64)
        images = to_uint8_exact(box_project(x01, k, 1.0, 0.0, 1.0), k)
    else:
        images = quantize(y)
    return {"images": images.cpu(), "residual": residuals(y, totals).cpu(),
            "residual_u8": residuals_u8(images, totals.to(images.device)).cpu(),
            "out_of_range": ((x01 < 0) | (x01 > 1)).to(torch.float32).mean((1, 2, 3)).cpu()}


@torch.no_grad()
def sample_group(model: nn.Module, group: str, *, shape: tuple[int, int, int], n: int, full: int,
                 totals: Tensor, model_totals: Tensor, seed: int, betas: Tensor, ddim_steps: int, eta: float,
                 deterministic: bool, device: torch.device) -> dict[str, dict[str, Tensor]]:
    """Sample one chunk of ``n`` images of ``group`` from the noise stream ``seed``.

    ``full`` is the chunk's nominal size: :math:`x_T` is drawn as ``full`` images and the first ``n`` kept, so a
    shorter chunk pairs image by image with a full one of another group. ``totals`` are the channel sums in
    ``[0, 1]`` units, ``model_totals`` in the model's ``[-1, 1]`` space.

    Returns ``{variant key: {"images", "residual", "residual_u8", "out_of_range"}}`` for the group's variants
    (the DDPM group's deterministic row also ``"diff_to_projection"``: per image the largest absolute difference
    to ``DDPM + projection`` in the model's units)."""
    from hardeq import diffusion

    C, H, W = shape
    gen = torch.Generator().manual_seed(int(seed))
    x_T = torch.randn((full, C, H, W), generator=gen)[:n].to(device)
    cond_gen = torch.Generator(device=device).manual_seed(int(seed) + 1)
    con = diffusion.channel_sum_constraint((n, C, H, W), model_totals.to(torch.float32), device=device)
    if group == "ddpm":
        T = betas.shape[0]
        captured: dict[str, Tensor] = {}

        def keep_x1(i: int, t: int, x: Tensor, x0: Tensor) -> None:
            if i == T - 2:
                captured["x1"] = x.clone()

        step_gen = torch.Generator(device=device).manual_seed(int(seed) + 2)
        y = diffusion.ddpm_sample(model, (n, C, H, W), diffusion.DDPMOptions(betas=betas, device=device), noise=x_T,
                                  generator=step_gen, callback=keep_x1)
        last_step = diffusion.DDPMOptions(betas=betas[:1], device=device)  # the loop's last step, from x_1

        def last(options: Any, **kw: Any) -> Tensor:
            return diffusion.ddpm_sample(model, (n, C, H, W), options, constraint=con, noise=captured["x1"], **kw)

        outs = {"ddpm": y,
                "ddpm+ours": last(replace(last_step, deterministic=deterministic), condition_generator=cond_gen),
                "ddpm+ours+det": last(replace(last_step, deterministic=True)),
                "ddpm+ours+box": last(replace(last_step, final="box"))}
        base = "ddpm"
    elif group == "ddim":
        opts = diffusion.DDIMOptions(num_steps=ddim_steps, betas=betas, eta=eta, device=device)
        y = diffusion.ddim_sample(model, (n, C, H, W), opts, noise=x_T, generator=gen)
        outs = {"ddim": y}
        base = "ddim"
    elif group.startswith("ddim@"):
        text, suffix = split_group(group)
        opts = diffusion.DDIMOptions(num_steps=ddim_steps, betas=betas, eta=eta, device=device,
                                     deterministic=deterministic or suffix == "+det",
                                     final="box" if suffix == "+box" else None)
        y = diffusion.ddim_sample(model, (n, C, H, W), opts, constraint=con, schedule=parse_schedule(text), noise=x_T,
                                  generator=gen, condition_generator=cond_gen)
        return {group: _summary(y, totals, box=suffix == "+box")}
    else:
        raise ValueError(f"unknown sampling group {group!r}.")
    outs[f"{base}+project"] = diffusion.project_onto(con, outs[base])
    outs[f"{base}+project+clip"] = diffusion.project_and_clip(con, outs[base], -1.0, 1.0)
    if base == "ddpm":  # the sampled last step, saved through box projection and to_uint8_exact like the box row
        outs["ddpm+ours+u8"] = outs["ddpm+ours"]
    res = {k: _summary(v, totals, box=k.endswith(("+box", "+u8"))) for k, v in outs.items()}
    if base == "ddpm":
        diff = (outs["ddpm+ours+det"].double() - outs["ddpm+project"].double()).abs()
        res["ddpm+ours+det"]["diff_to_projection"] = diff.flatten(1).max(1).values.cpu()
    return res


#: why every sampler runs unclipped (recorded with the results)
CLIP_REASON = ("clip_sample=False for every row (diffusers' DDPMScheduler defaults to clip_sample=True): clipping the "
               "x0-prediction to [-1, 1] at each step moves pixels one by one, so a clipped conditioned x0 would no "
               "longer satisfy A x0 = k, and the rows are compared like for like, differing only in how the "
               "constraint is handled; clipping the final images is a row of its own (+ projection + clip). The "
               "paper does not say whether its samplers clip.")
#: why the conditioned steps use beta_t (recorded with the results)
VARIANCE_REASON = ("the paper does not specify the variance of a conditioned step; this study conditions "
                   "N(x0_hat, beta_t I) (DDPM's 'fixed_large' variance at the step's train timestep, "
                   "sqrt(beta_0) = {last:.3g} standard deviation at DDPM's last step), because DDPM's own "
                   "'fixed_small' variance is 0 at t = 0 and a point mass cannot be conditioned; a project choice, "
                   "not the paper's")


def describe_samplers(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What each sampler of the study uses, for the results document: the loop, the variance of its
    unconditioned and of its conditioned steps, whether it clips, and why (settings ``s``). Read from the
    options objects :func:`sample_group` builds (the study sets only ``betas``, ``num_steps``, ``eta``,
    ``deterministic``, ``final`` and ``device``; everything else is the options' default)."""
    from hardeq import diffusion

    d, sm = s["diffusion"], s["sampling"]
    betas = diffusion.make_betas(int(d["num_train_timesteps"]), float(d["beta_start"]), float(d["beta_end"]),
                                 d["beta_schedule"])
    ddpm = diffusion.DDPMOptions(betas=betas)
    ddim = diffusion.DDIMOptions(num_steps=int(sm["ddim_steps"]), betas=betas, eta=float(sm["eta"]))
    common = {"clip_sample": False, "post": ddpm.post, "clip_reason": CLIP_REASON,
              "conditioned_step_variance": "beta_t" if ddpm.scale is None else repr(ddpm.scale),
              "conditioned_step": "sample" if not bool(sm["deterministic"]) else "conditional mean",
              "variance_reason": VARIANCE_REASON.format(last=math.sqrt(float(betas[0])))}
    return {"DDPM": {"loop": f"ancestral DDPM over all T = {betas.shape[0]} train timesteps",
                     "step_variance": f"{ddpm.variance_type}: (1 - abar_(t-1)) / (1 - abar_t) beta_t (diffusers' "
                                      "default; 0 at t = 0)", **common},
            "DDIM": {"loop": f"DDIM, {ddim.steps()} steps ({ddim.timestep_spacing} spacing), eta = {ddim.eta}",
                     "step_variance": ("eta^2 (1 - abar_t') / (1 - abar_t) (1 - abar_t / abar_t') = 0 (eta = 0: "
                                       "deterministic updates)" if ddim.eta == 0 else
                                       f"eta^2 (1 - abar_t') / (1 - abar_t) (1 - abar_t / abar_t'), eta = {ddim.eta}"),
                     **common}}
