"""The swap mechanics, and the kinds of piece that get fused.

:func:`~liger_lab.hf.patch` changes objects that transformers owns: a class in a modeling module, the module's
``apply_rotary_pos_emb``, a causal LM's ``forward``. Every such change is a *swap* kept here with the original it
displaced, held by whoever needs it (a patched model, a patched family, an unpickled fused attention) and undone when
the last holder lets go, so :func:`~liger_lab.hf.unpatch` puts back exactly what was there. A fused class is made
once per transformers class (:func:`fused_subclass`) and remembered both ways, which is how a patched module finds
its way back.

:data:`PIECE_KINDS` lists the kinds of module that have fused versions, one entry each: the class-name suffix, the
option of ``patch()`` that fuses it, the :class:`~liger_lab.hf.families.Family` flag saying a family has one, and
what :func:`~liger_lab.hf.patch_report` calls it. How each kind is built lives with the fused forwards
(``modules._BUILDERS``), which import this file: nothing here imports them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class _Swap:
    """``owner.name`` replaced for as long as at least one holder (a patched model or a patched family) needs
    it; the original comes back when the last holder lets go."""

    def __init__(self, original: object) -> None:
        self.original = original
        self.holders: weakref.WeakSet = weakref.WeakSet()


_SWAPS: dict[tuple[object, str], _Swap] = {}


def original_of(owner: object, name: str) -> Any:
    """``owner.name`` as transformers defined it, whether or not it is swapped now."""
    swap = _SWAPS.get((owner, name))
    return swap.original if swap is not None else vars(owner)[name]


def hold(owner: object, name: str, replacement: object, holder: object) -> None:
    swap = _SWAPS.get((owner, name))
    if swap is None:
        swap = _SWAPS[(owner, name)] = _Swap(vars(owner)[name])
        setattr(owner, name, replacement)
    if holder not in swap.holders:
        # A patched model that is garbage-collected without unpatch lets go too.
        weakref.finalize(holder, _release_collected, owner, name).atexit = False
    swap.holders.add(holder)


def release(owner: object, name: str, holder: object | None) -> None:
    swap = _SWAPS.get((owner, name))
    if swap is None:
        return
    if holder is not None:
        swap.holders.discard(holder)
    # Iterating a WeakSet skips holders that are being collected right now.
    if not any(True for _ in swap.holders):
        setattr(owner, name, swap.original)
        del _SWAPS[(owner, name)]


_RELEASE_AFTER_COMPILE: list[tuple[object, str]] = []


def _release_collected(owner: object, name: str) -> None:
    """What the collection of a holder does: :func:`release`, except in the middle of a ``torch.compile``, where
    it waits for the compile to end. The collector runs whenever Python allocates, so also while Dynamo traces a
    frame of the same family (after ``torch._dynamo.reset()`` drops the compiled code that kept a patched model
    alive, say). Putting transformers' ``apply_rotary_pos_emb`` back then changes the function the frame calls
    between two passes over it: Dynamo's restarted trace diverges from the first (``SpeculationLogDivergence``), or
    its guards are built on the dispatcher it traced but read the function now there (an internal error on
    ``apply_rotary_pos_emb.__closure__``). Both fail the compile. Once it ends, the swap goes as usual: the
    compiled frame's guards then fail on the next call and it recompiles against the original."""
    if not torch.compiler.is_compiling():  # True for the whole compile, also in code that Dynamo does not trace
        release(owner, name, None)
        return
    _RELEASE_AFTER_COMPILE.append((owner, name))
    callbacks = torch._dynamo.callback_handler  # cleared by torch._dynamo.reset(): registered again when needed
    if _release_deferred not in callbacks.end_callbacks:
        callbacks.register_end_callback(_release_deferred)


def _release_deferred(_: object) -> None:
    """Dynamo's end-of-compile callback: the releases that :func:`_release_collected` held back. (A compile that
    runs no such callbacks, ``torch.export``'s, leaves them to the next one: the dispatcher meanwhile runs
    transformers' function for every model but a patched one, as it does while installed.)"""
    while _RELEASE_AFTER_COMPILE:
        release(*_RELEASE_AFTER_COMPILE.pop(), None)


# Fused subclass of each transformers class, and the way back.
_FUSED: dict[type, type] = {}
UNFUSED: dict[type, type] = {}

# Where pickle records the fused classes: the package, whose __getattr__ rebuilds them by name in any process. The
# package rather than the file that builds them, so that moving code between its files leaves saved models loadable.
_PICKLE_HOME = __package__


# The names of fused classes that are not ``Fused`` + the original's: an original whose name another family's modeling
# module has too (Qwen2MLP, Qwen2's and Qwen2.5-VL's text MLP) gets one that says which (modules._fused_name, which
# fills this before the class is made), so that a name finds one class.
FUSED_NAMES: dict[type, str] = {}


def fused_subclass(original: type, forward: Callable[..., torch.Tensor], **attributes: object) -> type:
    """A subclass of ``original`` that only overrides ``forward`` (made once per class). Its ``__qualname__`` is
    its name, ``Fused`` + the original's (or the one in ``FUSED_NAMES``), under which ``liger_lab.hf`` finds it
    for pickle."""
    if original not in _FUSED:
        name = FUSED_NAMES.get(original, f"Fused{original.__name__}")
        namespace = {"__module__": _PICKLE_HOME, "__doc__": f"{original.__name__} on liger_lab kernels"}
        fused = type(name, (original,), {**namespace, "forward": forward, **attributes})
        _FUSED[original], UNFUSED[fused] = fused, original
    return _FUSED[original]


@dataclass(frozen=True)
class PieceKind:
    """A kind of module in a modeling module that has a fused version (its builder: ``modules._BUILDERS``)."""

    suffix: str  # class-name suffix: a family's class is prefix + suffix (or what the family's names say)
    option: str  # the option of patch() that fuses it, a field of families.Options
    flag: str  # the families.Family field that says whether a family has one
    label: str  # what patch_report counts it as
    # The kernel scales by the module's weight: a module without one (Gemma 4's with_scale=False) keeps its class.
    needs_weight: bool = False
    # act(gate) * up with the kernel the config's activation picks: without a kernel for it the module stays as it is.
    gated: bool = False


PIECE_KINDS: dict[str, PieceKind] = {
    kind.suffix: kind
    for kind in (
        PieceKind("RMSNorm", option="rms_norm", flag="rms_norm", label="RMSNorm", needs_weight=True),
        # Nemotron's norm: a LayerNorm (with bias) that scales by 1 + w. The norm option of patch() covers it too.
        PieceKind("LayerNorm1P", option="rms_norm", flag="layer_norm_1p", label="LayerNorm (1 + w)", needs_weight=True),
        PieceKind("MLP", option="swiglu", flag="mlp", label="gated MLP (SwiGLU/GeGLU)", gated=True),
        PieceKind("Attention", option="rope", flag="rope", label="attention (RoPE)"),
        PieceKind("DecoderLayer", option="rms_norm", flag="add_norm", label="residual add into RMSNorm"),
        PieceKind("Experts", option="swiglu", flag="experts", label="MoE experts", gated=True),
    )
}
"""Every kind of fused piece, by class-name suffix. A new kind is one entry here and its builder."""
