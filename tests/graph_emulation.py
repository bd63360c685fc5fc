"""CUDA graphs emulated on CPU, to run the HF runner's captured steps without a GPU.

A CUDA graph records the kernels a step launches, with the addresses they
read and write, and replays them without running the Python that launched
them: a value the step read on the host at capture is baked in, and a host
synchronisation during capture is an error. :class:`EmulatedGraphs` does the
same with torch operations: capturing records every aten operation the step
dispatches (its arguments are the recorded tensors, its outputs kept), and a
replay re-runs each recorded operation on the recorded tensors, writing its
results into the recorded outputs; views are not re-made (they alias the
recorded storage already), in-place and ``out=`` operations write where they
wrote at capture. So a per-step value that the step took from the host, not
from a static input tensor, gives the capture step's value again on the next
replay, and wrong rows. Operations that need the host to read device data
(``.item()``, ``.tolist()``, ``nonzero``, data-dependent shapes) and tensors
made from host data raise :class:`HostSyncDuringCapture`.

With ``emulated_graphs()`` active, the runner captures its one-token steps
on CPU through an :class:`EmulatedGraphs` (see
:func:`genlm_backend.llm.hf.capture.graph_capture`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from genlm_backend.llm.hf import capture as hf_capture

_aten = torch.ops.aten

_HOST_READS = {
    _aten.lift_fresh.default,  # torch.tensor(host data): the value would be baked in
    _aten.is_nonzero.default,
}
_HOST_READ_TAGS = {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape}


class HostSyncDuringCapture(RuntimeError):
    """Raised when a step being captured reads device data on the host, or makes a tensor from host data."""


class _Recording(TorchDispatchMode):
    """Runs a step's operations and records each with its arguments and outputs."""

    def __init__(self):
        super().__init__()
        self.operations: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS or _HOST_READ_TAGS & set(func.tags):
            raise HostSyncDuringCapture(
                f"{func} inside a captured step needs the host (a sync, or host data baked in)"
            )
        output = func(*args, **kwargs)
        self.operations.append((func, args, kwargs, output))
        return output


def _writes_an_argument(func) -> bool:
    return any(
        argument.alias_info is not None and argument.alias_info.is_write
        for argument in func._schema.arguments
    )


def _is_a_view(func, args, kwargs, output) -> bool:
    """Whether the operation only made views of its arguments (``to``, ``reshape`` and ``contiguous`` may copy instead)."""
    if not func.is_view:
        return False
    storages = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    return all(_storage(t) in storages for t in outputs)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class EmulatedGraph:
    """One recorded step; :meth:`replay` re-runs its operations on the recorded tensors."""

    def __init__(self, operations: list[tuple]):
        # Views alias recorded storage already: only computing operations are replayed.
        self._operations = [
            (func, args, kwargs, None if _writes_an_argument(func) else output)
            for func, args, kwargs, output in operations
            if not _is_a_view(func, args, kwargs, output)
        ]
        self.num_operations = len(self._operations)

    def replay(self) -> None:
        for func, args, kwargs, recorded in self._operations:
            result = func(*args, **kwargs)
            if recorded is None:
                continue  # it wrote into its arguments, as at capture
            for into, value in zip(tree_flatten(recorded)[0], tree_flatten(result)[0]):
                if isinstance(into, torch.Tensor):
                    if into.shape != value.shape:
                        raise HostSyncDuringCapture(
                            f"{func} gave shape {tuple(value.shape)} on replay, "
                            f"{tuple(into.shape)} at capture (a data-dependent shape)"
                        )
                    into.copy_(value)


@contextlib.contextmanager
def _host_reads_without_dispatch_raise() -> Iterator[None]:
    """``tolist`` and ``numpy`` read CPU memory without an operation to see: make them raise too."""

    def host_read(self, *args, **kwargs):
        raise HostSyncDuringCapture("a tensor read on the host inside a captured step")

    with (
        mock.patch.object(torch.Tensor, "tolist", host_read),
        mock.patch.object(torch.Tensor, "numpy", host_read),
    ):
        yield


class EmulatedGraphs:
    """Captures steps as :class:`EmulatedGraph`\\ s; counts captures and replays."""

    def __init__(self):
        self.num_captures = 0
        self.num_replays = 0

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """``(replay, output)``: the step's recorded operations, and the tensor its replays write into."""
        recording = _Recording()
        with recording, _host_reads_without_dispatch_raise():
            output = step()
        graph = EmulatedGraph(recording.operations)
        self.num_captures += 1

        def replay() -> None:
            self.num_replays += 1
            graph.replay()

        return replay, output


@contextlib.contextmanager
def emulated_graphs() -> Iterator[EmulatedGraphs]:
    """While active, runners capture their one-token steps on any device through one :class:`EmulatedGraphs`."""
    graphs = EmulatedGraphs()
    with mock.patch.object(hf_capture, "graph_capture", lambda device: graphs):
        yield graphs
