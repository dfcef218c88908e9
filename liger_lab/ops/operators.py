"""Declaring an op's PyTorch operators once: the in-place twin, the fake and the autograd come from one declaration.

An op's kernels run inside ``liger_lab::`` operators, so that ``torch.compile`` sees one opaque call with a known
output, DTensor shards it by a registered strategy, and dispatch modes see it by name. :func:`define` declares
them from two things written once:

* ``impl``, the launcher in **destination-passing style**: it takes the operator's arguments followed by one buffer
  per output, and writes the results into those buffers (it returns nothing);
* ``outputs``, one allocator per output, by name (the trailing parameters of ``impl``), each returning an empty
  tensor of the output's shape, dtype, layout and device. An allocator's parameters are named after the
  operator's arguments it reads, and it is called with those alone (``lambda x: dense_like(x)``,
  ``def grad_weight(weight, accumulation, needs)``): which arguments it gets is decided by name once, here, so an
  allocator never counts positions and a renamed argument is a ``TypeError`` at import, not a wrong shape.

From them come the functional operator ``liger_lab::<name>`` (allocate every output, run ``impl``, return them)
and its fake (the allocators alone, on fake tensors: the fake cannot drift from what the real operator returns).
``in_place={"dx": "dy"}`` also declares ``liger_lab::<name>_``, which writes output ``dx`` over its argument
``dy`` (marked mutated in its schema, its version bumped so that autograd refuses a stale saved copy) and returns
the other outputs: the same ``impl`` with ``dy`` passed as the ``dx`` buffer, the same allocators for the rest.
Validation belongs to the public function that calls the operator, which runs once per call in either mode.
``setup_context`` and ``backward`` (as in ``torch.library.register_autograd``) register the functional operator's
autograd formula. Under ``create_graph=True`` the formula still gives the first-order gradients, but differentiating
them again raises, naming the op: the Triton kernels of a backward have no derivative that autograd could build,
and a second derivative must be right or an error, never a silent zero.

Why this shape, and not others:

* **Two operators, not one mutating operator called with its input as the output buffer** (QuACK's style, one
  generic fake that does nothing). DTensor places an operator's outputs from its sharding strategy: the norms'
  dw is ``Partial`` on sharded rows, which a buffer the caller allocated cannot be. PyTorch registers autograd
  formulas only on functional operators. And under ``torch.compile`` functionalization turns a mutated argument
  into a copy unless a pass proves it dead. So the default call stays functional, and the in-place twin is
  derived from it rather than the other way round.
* **Not ``torch.library.custom_op``.** Its wrappers (argument defaults filled in, Dynamo disabled around the
  kernel, a Python autograd layer with its own bookkeeping) cost more host time per call than the dispatcher
  itself. The operators here are defined on a ``torch.library.Library`` with the schema that ``custom_op`` would
  infer from the same annotations (``torch.library.infer_schema``), the kernel registered as
  ``CompositeExplicitAutograd`` and the fake with ``torch.library.register_fake``; the autograd kernel is
  :func:`_autograd_kernel`. The host-time benchmark (``benchmarks/host_time.py``) measures the difference, and
  ``benchmarks/notes/host_time.md`` holds its numbers.
* **Not ``torch.library.triton_op``.** Eagerly it works in Triton's interpreter, but under ``torch.compile`` its
  fake runs the launcher on fake tensors, whose memory the interpreter then tries to read (a ``RuntimeError``
  in Dynamo): the interpreter, where CI runs, could not compile any op.

**Eager calls skip the dispatcher** (QuACK's eager bypass). Calling an operator from Python costs two trips
through the dispatcher per call (the autograd kernel, then below autograd the kernel itself), each a C++ to Python
crossing with its own argument parsing. Where nothing could observe or transform the call, an :class:`Operator`
called as a function runs the same Python kernel and the same autograd formula directly (:func:`_eager`): no
compiler tracing, no dispatch or function mode (``FakeTensorMode``, ``FlopCounterMode``, a test's call recorder),
no functorch transform, no profiler (whose traces name the operators), and every tensor argument a plain
``torch.Tensor`` or ``nn.Parameter`` (not a ``DTensor``, a fake or a functional tensor). Everything else goes
through the registered operators, so ``torch.compile``, FSDP2, DTensor and ``opcheck`` see exactly what they saw
before; the results are the same either way (the same kernel runs), which the tests check call by call.

**Under ``torch.compile`` the row ops lower to Inductor** (:func:`lowered`). In a compiled model the operator is an
opaque call that Inductor's wrapper makes from Python, so each of its launches costs the host as much as eagerly,
while the code Inductor generates for the same PyTorch formula costs the host nothing per call and fuses with its
neighbours (the residual add into the norm, the RoPE into the projections' epilogues). For the norms, RoPE and the
gated activations, whose kernels are level with Inductor's on the GPU, the public functions therefore trace their
PyTorch formula (:mod:`liger_lab.reference`, Hugging Face's own expressions) while Dynamo traces them:
:data:`LOWERED_UNDER_COMPILE` lists them, ``benchmarks/notes/host_time.md`` holds the measurement behind the
choice. The losses stay operators: their point is the memory a formula would spend on the logits. Inside
:func:`kernels_under_compile` every op compiles as its operator (how the tests and chapter 09 compile the kernels
themselves).

Operators without a formula (backward operators, and the losses whose ``torch.autograd.Function`` makes the
gradient in the forward) get no autograd kernel: called from a backward, or from a ``Function.forward``, they
never see a tensor that autograd would follow.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

Allocator = Callable[..., torch.Tensor]
"""Called with an operator's arguments; returns one empty output (real tensors eagerly, fake ones when tracing)."""

_LIBRARY = torch.library.Library("liger_lab", "FRAGMENT")
_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd


@dataclass(frozen=True)
class Operator:
    """The operators one :func:`define` made: ``default`` returns fresh outputs, ``in_place`` (None unless declared)
    writes the declared outputs over their arguments and returns the others. Both are ``OpOverload``\\ s.

    Call the operator as a function (``op(*args)``, ``op.call_in_place(*args)``), with its arguments in schema
    order: eagerly that skips the dispatcher (see the module docstring), and anywhere else it calls the
    ``OpOverload``."""

    name: str
    default: torch._ops.OpOverload
    in_place: torch._ops.OpOverload | None = None
    eager_default: Callable[..., object] | None = None
    """The dispatcher-free call of ``default``: its autograd formula (when it has one) over its Python kernel."""
    eager_in_place: Callable[..., object] | None = None

    def __call__(self, *args: object) -> object:
        if _eager(args):
            return self.eager_default(*args)
        return self.default(*args)

    def call_in_place(self, *args: object) -> object:
        if _eager(args):
            return self.eager_in_place(*args)
        return self.in_place(*args)


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None), torch.dtype, list, tuple})
"""Argument types that never carry a dispatch of their own (a list of the schema holds flags, never tensors)."""


def _eager(args: tuple) -> bool:
    """Whether a call with these arguments may skip the dispatcher: nothing traces, observes or transforms it, and
    every tensor argument is a plain tensor (a subclass, such as ``DTensor`` or a fake tensor, has its own
    dispatch). Each test is a C++ flag read or a set lookup: together a microsecond or two."""
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
        or torch._C._autograd._profiler_enabled()
    ):
        return False
    return _PLAIN.issuperset(map(type, args))


LOWERED_UNDER_COMPILE = frozenset({"rms_norm", "add_rms_norm", "layer_norm", "rope", "swiglu", "geglu"})
"""Public functions that trace their PyTorch formula under ``torch.compile`` instead of calling their operator."""

_lower_under_compile = True


def lowered(name: str) -> bool:
    """Whether the public function ``name`` should return its PyTorch formula rather than call its operator: only
    while Dynamo traces it, for an op of :data:`LOWERED_UNDER_COMPILE`, outside :func:`kernels_under_compile`.
    Eagerly this is one flag read; in a traced function Dynamo folds it to a constant (and guards on the switch)."""
    return torch.compiler.is_compiling() and _lower_under_compile and name in LOWERED_UNDER_COMPILE


@contextlib.contextmanager
def kernels_under_compile() -> Iterator[None]:
    """Within the block, functions traced by ``torch.compile`` call every op's operator, Triton kernels included,
    instead of lowering the row ops to Inductor (a function compiled inside the block recompiles outside it)."""
    global _lower_under_compile
    previous, _lower_under_compile = _lower_under_compile, False
    try:
        yield
    finally:
        _lower_under_compile = previous


def dense_like(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty contiguous tensor of ``tensor``'s shape (and dtype, unless given) on its device: the usual output of
    a kernel that writes rows, whatever the input's strides."""
    return tensor.new_empty(tensor.shape, dtype=dtype)


def define(
    name: str,
    impl: Callable[..., None],
    *,
    outputs: Mapping[str, Allocator],
    in_place: Mapping[str, str] | None = None,
    mutates: Sequence[str] = (),
    setup_context: Callable[..., None] | None = None,
    backward: Callable[..., object] | None = None,
) -> Operator:
    """Declare ``liger_lab::<name>`` (and, with ``in_place``, ``liger_lab::<name>_``); see the module docstring.

    ``impl(*args, *buffers)``: the operator's arguments, annotated (they make the schema, as for ``custom_op``),
    then one parameter per output named as in ``outputs``, in that order. ``in_place``: output name -> the argument
    it is written over in the twin. ``mutates``: arguments that ``impl`` writes in every variant (an operator
    without outputs, such as a scale in place). ``setup_context(ctx, inputs, output)`` and
    ``backward(ctx, *grads)`` are ``torch.library.register_autograd``'s; ``inputs`` are the operator's arguments
    and ``output`` what it returned."""
    output_names = tuple(outputs)
    parameters = list(inspect.signature(impl).parameters.values())
    split = len(parameters) - len(output_names)
    arguments, buffers = parameters[:split], parameters[split:]
    if tuple(p.name for p in buffers) != output_names:
        raise TypeError(f"{name}: impl's last parameters must be the outputs {output_names}, got {buffers}")
    argument_names = [p.name for p in arguments]
    allocators = tuple(_by_name(name, output, allocate, argument_names) for output, allocate in outputs.items())
    in_place = dict(in_place or {})

    default, eager_default = _register(name, impl, arguments, allocators, written_over={}, mutates=mutates)
    twin = eager_twin = None
    if in_place:
        written_over = {output_names.index(out): argument_names.index(arg) for out, arg in in_place.items()}
        twin, eager_twin = _register(
            f"{name}_", impl, arguments, allocators, written_over, mutates=(*mutates, *in_place.values())
        )
    if backward is not None:
        eager_default = _register_autograd(name, default, eager_default, setup_context, backward)
    return Operator(name, default, twin, eager_default, eager_twin)


def reads(allocate: Callable[..., torch.Tensor], *names: str) -> Allocator:
    """``allocate`` as an allocator that reads the operator's arguments ``names``, handed to it in that order: for
    an allocator shared by operators that name the same arguments differently (a student's hidden states)."""

    def allocator(*args: object) -> torch.Tensor:
        return allocate(*args)

    allocator.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY) for name in names]
    )
    allocator.__name__ = getattr(allocate, "__name__", "allocator")
    return allocator


def allocate_outputs(
    impl: Callable[..., None], outputs: Mapping[str, Allocator], args: Sequence[object]
) -> list[torch.Tensor]:
    """The buffers :func:`define` would allocate for ``impl(*args, *buffers)``: each allocator handed the arguments
    it names. For a test that runs a launcher itself (a dispatch mode sees an operator's call, not inside it)."""
    names = list(inspect.signature(impl).parameters)[: len(args)]
    return [_by_name(impl.__name__, output, allocate, names)(tuple(args)) for output, allocate in outputs.items()]


def _by_name(name: str, output: str, allocate: Allocator, argument_names: list[str]) -> Callable[[tuple], torch.Tensor]:
    """``allocate`` as a function of the operator's whole argument tuple, handing it the arguments its parameters
    name (picked by index, worked out once)."""
    wanted = list(inspect.signature(allocate).parameters)
    unknown = [parameter for parameter in wanted if parameter not in argument_names]
    if unknown:
        raise TypeError(
            f"{name}: the allocator of {output!r} reads {unknown}, which are not arguments {argument_names}"
        )
    if not wanted:
        return lambda args: allocate()
    pick = operator.itemgetter(*(argument_names.index(parameter) for parameter in wanted))
    if len(wanted) == 1:
        return lambda args: allocate(pick(args))
    return lambda args: allocate(*pick(args))


def _register(
    name: str,
    impl: Callable[..., None],
    arguments: list[inspect.Parameter],
    allocators: tuple[Callable[[tuple], torch.Tensor], ...],
    written_over: dict[int, int],
    mutates: Sequence[str],
) -> tuple[torch._ops.OpOverload, Callable[..., object]]:
    """One operator: its schema, its kernel and its fake. ``written_over``: output index -> the index of the
    argument that is its buffer; the other outputs are allocated and returned. Returns the operator and its Python
    kernel (what an eager call runs without the dispatcher)."""
    returned = tuple(allocator for index, allocator in enumerate(allocators) if index not in written_over)
    prototype = _prototype(arguments)
    schema = torch.library.infer_schema(prototype, mutates_args=tuple(mutates))
    returns = "Tensor" if len(returned) == 1 else f"({', '.join(['Tensor'] * len(returned))})"
    _LIBRARY.define(name + schema.removesuffix("()") + returns, tags=(torch.Tag.pt2_compliant_tag,))
    mutated = tuple(index for index, p in enumerate(arguments) if p.name in mutates)

    def result(made: list[torch.Tensor]) -> object:  # the schema's returns: (), Tensor or a tuple
        return None if not made else made[0] if len(made) == 1 else tuple(made)

    if not written_over and not mutated:  # the functional operator: every output allocated and returned

        def kernel(*args: object) -> object:
            made = [allocator(args) for allocator in allocators]
            impl(*args, *made)
            return result(made)

    else:
        # Per output: the index of the argument that is its buffer, or None and the allocator that makes it.
        sources = tuple((written_over.get(i), None if i in written_over else a) for i, a in enumerate(allocators))

        def kernel(*args: object) -> object:
            buffers = [args[index] if allocator is None else allocator(args) for index, allocator in sources]
            impl(*args, *buffers)
            for index in mutated:  # what an ADInplaceOrView kernel would do: a saved copy of it is now stale
                if not args[index].is_inference():
                    torch.autograd.graph.increment_version(args[index])
            return result([buffer for buffer, (index, _) in zip(buffers, sources, strict=True) if index is None])

    def fake(*args: object) -> object:
        return result([allocator(args) for allocator in returned])

    qualified = f"liger_lab::{name}"
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(qualified, fake, lib=_LIBRARY)
    return getattr(torch.ops.liger_lab, name).default, kernel


def _prototype(arguments: list[inspect.Parameter]) -> Callable[..., None]:
    """A function with exactly these parameters and no outputs, for ``infer_schema``."""

    def prototype(*args: object) -> None: ...

    prototype.__signature__ = inspect.Signature(arguments, return_annotation=None)
    return prototype


def _register_autograd(
    name: str,
    op: torch._ops.OpOverload,
    kernel: Callable[..., object],
    setup_context: Callable[..., None] | None,
    backward: Callable[..., object],
) -> Callable[..., object]:
    """The autograd kernel of ``op``: an ``autograd.Function`` built from the formula, entered only when a tensor
    argument requires grad in grad mode (else straight below autograd). Returns the same formula over ``kernel``,
    the operator's Python kernel, for eager calls that skip the dispatcher."""

    def below_autograd(*args: object) -> object:
        with _BELOW_AUTOGRAD():
            return op(*args)

    def function_over(run: Callable[..., object], suffix: str) -> Callable[..., object]:
        def forward(ctx, *args):
            output = run(*args)
            if setup_context is not None:
                setup_context(ctx, args, output)
            return output

        members = {"forward": staticmethod(forward), "backward": staticmethod(backward_once)}
        return type(f"{name}_{suffix}", (torch.autograd.Function,), members).apply

    def backward_once(ctx, *grads):
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        # create_graph=True: the gradients come out as asked, but differentiating them again raises. They depend
        # on the upstream gradients and on what the forward saved: through those a second derivative would flow.
        sources = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor)]
        with torch.no_grad():
            result = backward(ctx, *grads)
        return _refusing_second_derivative(name, result, sources)

    apply = function_over(below_autograd, "autograd")
    eager_apply = function_over(kernel, "eager")

    def autograd_kernel(*args: object) -> object:
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return apply(*args)
        return below_autograd(*args)

    def eager(*args: object) -> object:
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return eager_apply(*args)
        return kernel(*args)

    _LIBRARY.impl(name, autograd_kernel, "Autograd")
    return eager


class _NoSecondDerivative(torch.autograd.Function):
    """The identity on a first-order gradient made by Triton kernels; differentiating it raises, naming the op."""

    @staticmethod
    def forward(ctx, name: str, gradient: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
        ctx.name = name
        return gradient.view_as(gradient)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor) -> None:
        raise RuntimeError(
            f"liger_lab.{ctx.name} has no second derivative: its backward launches Triton kernels, which autograd "
            "cannot differentiate (double backward, a gradient penalty through it). Compute such a term with the "
            "plain PyTorch op (liger_lab.reference)."
        )


def _refusing_second_derivative(name: str, gradients: object, sources: list[torch.Tensor]) -> object:
    """``gradients`` (a backward's result: a tensor, None, or a tuple of them) as functions of ``sources`` without a
    derivative: they require grad where a source does, and differentiating them raises."""
    if isinstance(gradients, tuple):
        return tuple(_refusing_second_derivative(name, g, sources) for g in gradients)
    if isinstance(gradients, torch.Tensor):
        return _NoSecondDerivative.apply(name, gradients, *sources)
    return gradients
