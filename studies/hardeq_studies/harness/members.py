r"""Models with ``M`` independent *members* trained together: vectorised (:class:`BatchedMLP`) or a loop
(:class:`MemberList`).

The harness needs two things from a member model: ``forward`` maps a batch to outputs ``(M, b, ...)``, and
:func:`merge_members` can take some members' parameters from one ``state_dict`` and the others' from another
(to keep each member's best-validation parameters, and to freeze members that stopped early). A model may
define ``merge_members(dst, src, mask)`` itself; otherwise every tensor of its ``state_dict`` is assumed to
have the member as its leading dimension. A plain module is a model with a single member.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BatchedMLP", "MemberList", "merge_members"]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "tanh": torch.tanh, "gelu": F.gelu}
_ACTIVATION_MODULES: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


def merge_members(model: nn.Module, dst: Mapping[str, Tensor], src: Mapping[str, Tensor],
                  mask: Tensor) -> dict[str, Tensor]:
    """A ``state_dict`` with member ``i`` taken from ``src`` where ``mask[i]`` and from ``dst`` elsewhere.

    Args:
        model: the member model (its own ``merge_members`` is used when it has one).
        dst, src: two ``state_dict`` s of ``model``.
        mask: ``(M,)`` booleans.
    """
    custom = getattr(model, "merge_members", None)
    if custom is not None:
        return custom(dst, src, mask)
    if mask.numel() == 1:  # a single member: the whole state is that member's (any tensor shapes)
        return {k: v.detach().clone() for k, v in (src if bool(mask) else dst).items()}
    out = {}
    for k, v in dst.items():
        m = mask.to(v.device).view((-1,) + (1,) * (v.dim() - 1))
        out[k] = torch.where(m, src[k], v)
    return out


class BatchedMLP(nn.Module):
    r"""``M`` independent multilayer perceptrons evaluated together (seeds x methods, vectorised).

    Layer ``l`` holds ``weight_l`` of shape ``(M, fan_in, fan_out)`` and ``bias_l`` of shape ``(M, 1, fan_out)``;
    the forward pass is ``h = act(baddbmm(bias, h, weight))``.

    Args:
        in_features: input size (shared by all members).
        hidden_features: sizes of the hidden layers, e.g. ``(32, 32)``.
        out_features: output size, one int for all members or one per member (outputs are then padded to
            the largest size with zero weights that never receive gradient: read ``output[i, :, :out_i]``).
        seeds: one seed per member. Member ``i`` gets exactly the parameters that ``nn.Linear``'s default
            initialisation draws after ``torch.manual_seed(seeds[i])`` for the layers in order, for a network
            with ``base_out_features[i]`` outputs (the global RNG state is left untouched).
        base_out_features: per member, how many leading outputs are initialised as the network with that
            many outputs (default: all of them). Outputs beyond it (e.g. a variance head added to a mean
            head) take the last-layer rows and biases that the wider network ``out_features[i]`` draws. With
            ``base_out_features = n`` every member of one seed starts with the same hidden layers *and* the
            same first ``n`` outputs, whatever extra outputs it has.
        activation: ``"relu"`` (default), ``"tanh"`` or ``"gelu"``.
        detach_outputs: optional boolean mask ``(M, max(out_features))``: the marked outputs are computed from
            *detached* last hidden features (a stop-gradient head: it trains its own output weights only).
        bias_only_outputs: optional boolean mask ``(M, max(out_features))``: the marked outputs are their bias
            alone (a learned constant per output, independent of the input).
        dtype, device: of the parameters.

    Shapes:
        input ``(M, B, in_features)`` (or ``(B, in_features)``, shared by all members);
        output ``(M, B, max(out_features))``.

    Example:
        >>> net = BatchedMLP(3, (32, 32), [3, 6], seeds=[0, 0])
        >>> net(torch.zeros(2, 5, 3)).shape
        torch.Size([2, 5, 6])
    """

    def __init__(self, in_features: int, hidden_features: Sequence[int], out_features: int | Sequence[int],
                 seeds: Sequence[int], *, base_out_features: Sequence[int] | None = None, activation: str = "relu",
                 detach_outputs: Tensor | None = None, bias_only_outputs: Tensor | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        seeds = [int(s) for s in seeds]
        if not seeds:
            raise ValueError("seeds must name at least one member, got an empty sequence.")
        if isinstance(out_features, int):
            out_features = [out_features] * len(seeds)
        out_features = [int(o) for o in out_features]
        if len(out_features) != len(seeds):
            raise ValueError(f"out_features has {len(out_features)} entries but there are {len(seeds)} seeds.")
        base = list(out_features) if base_out_features is None else [int(b) for b in base_out_features]
        if len(base) != len(seeds) or any(not 0 < b <= o for b, o in zip(base, out_features)):
            raise ValueError(f"base_out_features must give one size in [1, out_features[i]] per member, got {base} "
                             f"for out_features {out_features}.")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}.")
        self.in_features = int(in_features)
        self.hidden_features = tuple(int(h) for h in hidden_features)
        self.out_features = out_features
        self.base_out_features = base
        self.seeds = seeds
        self.activation = activation
        self._act = _ACTIVATIONS[activation]
        sizes = [self.in_features, *self.hidden_features, max(out_features)]
        self.num_layers = len(sizes) - 1
        M = len(seeds)
        weights = [torch.zeros(M, sizes[i], sizes[i + 1], dtype=dtype) for i in range(self.num_layers)]
        biases = [torch.zeros(M, 1, sizes[i + 1], dtype=dtype) for i in range(self.num_layers)]
        for m, (seed, out, b) in enumerate(zip(seeds, out_features, base)):  # one-off initialisation
            for i, layer in enumerate(self.reference_layers(seed, b)):
                weights[i][m, :, : layer.out_features] = layer.weight.detach().T.to(dtype)
                biases[i][m, 0, : layer.out_features] = layer.bias.detach().to(dtype)
            if out > b:
                wide = self.reference_layers(seed, out)[-1]
                weights[-1][m, :, b:out] = wide.weight.detach()[b:out].T.to(dtype)
                biases[-1][m, 0, b:out] = wide.bias.detach()[b:out].to(dtype)
        for i in range(self.num_layers):
            self.register_parameter(f"weight{i}", nn.Parameter(weights[i].to(device)))
            self.register_parameter(f"bias{i}", nn.Parameter(biases[i].to(device)))
        self._detach: Tensor | None
        self._bias_only: Tensor | None
        self.register_buffer("_detach", self._mask(detach_outputs, "detach_outputs", sizes[-1], device),
                             persistent=False)
        self.register_buffer("_bias_only", self._mask(bias_only_outputs, "bias_only_outputs", sizes[-1], device),
                             persistent=False)

    def _mask(self, mask: Tensor | None, name: str, width: int, device) -> Tensor | None:
        if mask is None:
            return None
        mask = torch.as_tensor(mask, dtype=torch.bool)
        if mask.shape != (self.num_members, width):
            raise ValueError(f"{name} must have shape (M, max(out_features)) = {(self.num_members, width)}, got "
                             f"{tuple(mask.shape)}.")
        return mask.unsqueeze(1).to(device) if bool(mask.any()) else None

    def reference_layers(self, seed: int, out_features: int) -> list[nn.Linear]:
        """The ``nn.Linear`` layers a per-seed script would build with ``torch.manual_seed(seed)`` (float32)."""
        sizes = [self.in_features, *self.hidden_features, out_features]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return [nn.Linear(sizes[i], sizes[i + 1]) for i in range(len(sizes) - 1)]

    def member(self, index: int) -> nn.Sequential:
        """Member ``index`` as an ordinary ``nn.Sequential`` of ``nn.Linear`` layers (a copy, same dtype;
        without the stop-gradient and bias-only masks, which only matter for training)."""
        layers: list[nn.Module] = []
        out = self.out_features[index]
        for i in range(self.num_layers):
            W = getattr(self, f"weight{i}")[index].detach()
            b = getattr(self, f"bias{i}")[index, 0].detach()
            if i == self.num_layers - 1:
                W, b = W[:, :out], b[:out]
            lin = nn.Linear(W.shape[0], W.shape[1], dtype=W.dtype, device=W.device)
            with torch.no_grad():
                lin.weight.copy_(W.T)
                lin.bias.copy_(b)
            layers.append(lin)
            if i < self.num_layers - 1:
                layers.append(_ACTIVATION_MODULES[self.activation]())
        return nn.Sequential(*layers)

    @property
    def num_members(self) -> int:
        return len(self.seeds)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:
            x = x.expand(self.num_members, *x.shape)
        h = x
        for i in range(self.num_layers - 1):
            h = self._act(torch.baddbmm(getattr(self, f"bias{i}"), h, getattr(self, f"weight{i}")))
        W, b = getattr(self, f"weight{self.num_layers - 1}"), getattr(self, f"bias{self.num_layers - 1}")
        out = torch.baddbmm(b, h, W)
        if self._detach is not None:
            out = torch.where(self._detach, torch.baddbmm(b, h.detach(), W), out)
        if self._bias_only is not None:
            out = torch.where(self._bias_only, b.expand_as(out), out)
        return out

    def extra_repr(self) -> str:
        return (f"members={self.num_members}, in={self.in_features}, hidden={self.hidden_features}, "
                f"out={sorted(set(self.out_features))}, activation={self.activation}")


class MemberList(nn.Module):
    """``M`` arbitrary modules trained as members by a plain loop (for models that cannot be vectorised).

    ``forward(x)`` feeds member ``i`` its own input ``x[i]`` when ``x`` has a leading member dimension of size
    ``M`` and ``per_member_inputs`` is true (the in-memory batch source gives every member its own
    minibatch), else the shared ``x``; outputs are stacked to ``(M, b, ...)`` (members must agree on the
    output shape).

    Args:
        members: the modules (independent parameters).
        per_member_inputs: see above.
    """

    def __init__(self, members: Sequence[nn.Module], *, per_member_inputs: bool = True) -> None:
        super().__init__()
        if not members:
            raise ValueError("members must hold at least one module, got an empty sequence.")
        self.members = nn.ModuleList(members)
        self.per_member_inputs = bool(per_member_inputs)

    @property
    def num_members(self) -> int:
        return len(self.members)

    def forward(self, x):
        if self.per_member_inputs and isinstance(x, Tensor) and x.dim() >= 2 and x.shape[0] == len(self.members):
            return torch.stack([m(x[i]) for i, m in enumerate(self.members)])
        return torch.stack([m(x) for m in self.members])

    def merge_members(self, dst: Mapping[str, Tensor], src: Mapping[str, Tensor], mask: Tensor) -> dict[str, Tensor]:
        """Member ``i``'s entries (keys ``members.i.*``) from ``src`` where ``mask[i]``, else from ``dst``.

        The entries taken from ``src`` are copies: ``src`` is often the live ``state_dict`` (whose tensors share
        storage with the parameters), and a best-validation state that aliased it would follow training."""
        take = {i for i, flag in enumerate(mask.tolist()) if flag}
        return {k: src[k].detach().clone() if int(k.split(".")[1]) in take else v for k, v in dst.items()}
