"""L2Residency: part of the depth decoder's weights kept in L2 from one depth step to the next.

At a few rows a frame reads the depth decoder's four layers 31 times: ~220 MB a depth step in bf16 (~110 MB in
e4m3), more than L2 (50 MB on the H100, 60 MB on the H200). A sweep larger than the cache keeps nothing of itself,
so every depth step reads all of it from HBM again. Persisting accesses (sm80+) keep part of it: the context sets
aside up to the device's max persisting size of L2 (cuCtxSetLimit), and the accesses that fall inside a kernel's
access-policy window (hitProp persisting) stay in that part, evicted only by other persisting lines. With one window
over the first P bytes of the depth weights (P <= the set-aside), each depth step after the first reads P bytes
fewer from HBM; normal accesses (the backbone, Mimi, the KV) keep the rest of L2.

- `pack` moves the depth decoder's GEMM weights into one allocation, the small GEMMs first (latency-bound: they gain
  the most per byte), so that one address range covers the bytes chosen. The modules keep their parameters and
  buffers, rebound to views of it (the same values). Once per model: a second runner on the same model finds them
  packed, and the first runner's graphs keep reading valid memory.
- `apply` gives every kernel node of a captured cudaGraph_t the window. It is set on the nodes before the graph is
  instantiated (FrameGraphs captures with keep_graph), so nothing depends on whether stream capture copies a
  stream's attributes into its nodes.

CSMSERVE_L2_RESIDENT_MB: the window in MB (0: off, the default; "max": the device's max persisting size). Measured
on the H100 (31.25 MB persisting; docs/benchmarks.md): level at 1-16 rows (fp8-all 1-2% slower), +10% at 64 rows and
+39-52% at 2,048 (the L2 set aside is lost to everything else), so it stays off. The driver calls
(ctypes on libcuda) are made only on CUDA devices that report a persisting size; `for_model` returns None elsewhere.
"""
from __future__ import annotations

import ctypes
import os
import warnings

import torch
from torch import Tensor, nn

from csmserve.models.csm import CSMModel
from csmserve.models.fp8 import FP8Linear

ALIGN = 256  # each weight's offset in the pack: the GEMV's 16-byte loads and the allocator's own alignment
DEFAULT_MB = "0"

_LIMIT_PERSISTING_L2 = 0x06  # CU_LIMIT_PERSISTING_L2_CACHE_SIZE
_ATTR_MAX_PERSISTING_L2 = 108  # CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE
_ATTR_MAX_WINDOW = 109  # CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE
_NODE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_ACCESS_POLICY_WINDOW = 1  # CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW (also CU_KERNEL_NODE_ATTRIBUTE_...)
NORMAL, PERSISTING = 0, 2  # CUaccessProperty


class Window(ctypes.Structure):  # CUaccessPolicyWindow
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class AttrValue(ctypes.Union):  # CUlaunchAttributeValue / CUkernelNodeAttrValue: a 64-byte union
    _fields_ = [("window", Window), ("pad", ctypes.c_char * 64)]


_lib: ctypes.CDLL | None = None


def driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        driver().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what}: {(name.value or b'?').decode()} ({result})")


def device_attribute(attr: int, device: torch.device) -> int:
    dev, value = ctypes.c_int(), ctypes.c_int()
    check(driver().cuDeviceGet(ctypes.byref(dev), device.index or 0), "cuDeviceGet")
    check(driver().cuDeviceGetAttribute(ctypes.byref(value), attr, dev), "cuDeviceGetAttribute")
    return value.value


def weight_name(module: nn.Module) -> str:
    return "weight8" if isinstance(module, FP8Linear) else "weight"  # the e4m3 buffer, else nn.Linear's weight


def depth_weights(model: CSMModel) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of the depth decoder's GEMM weights in window order: every layer's o and qkv (2-3 MB in
    bf16, latency-bound), the backbone -> decoder projection, every layer's down (16 MB), then gate_up (32 MB)."""
    layers = model.decoder.layers
    mods = ([b.self_attn.o_proj for b in layers] + [b.self_attn.qkv_proj for b in layers] + [model.projection]
            + [b.mlp.down_proj for b in layers] + [b.mlp.gate_up_proj for b in layers])
    return [(m, weight_name(m)) for m in mods]


def _inside(t: Tensor, flat: Tensor, offset: int) -> bool:
    return t.device == flat.device and t.data_ptr() == flat.data_ptr() + offset and t.is_contiguous()


def pack(entries: list[tuple[nn.Module, str]], device: torch.device, held: Tensor | None = None) -> Tensor:
    """The entries' tensors in one uint8 allocation, in order, each at an ALIGN-aligned offset; each module's
    parameter or buffer rebound to its view (same dtype, shape and values). `held`: a pack made before; returned
    as it is when every entry already lies where this order puts it (the same model packed again)."""
    offsets, total = [], 0
    for mod, name in entries:
        offsets.append(total)
        total += -(-getattr(mod, name).nbytes // ALIGN) * ALIGN
    if held is not None and len(held) == total and all(
            _inside(getattr(m, n), held, o) for (m, n), o in zip(entries, offsets)):
        return held
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    for (mod, name), off in zip(entries, offsets):
        t = getattr(mod, name)
        view = flat[off:off + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        if name in mod._parameters:
            mod._parameters[name].data = view  # the Parameter object stays: references to it see the pack
        else:
            mod._buffers[name] = view
    return flat


def window_bytes(requested: str, max_persisting: int, max_window: int, packed: int) -> int:
    """The window's size: CSMSERVE_L2_RESIDENT_MB's value ("max" or MB), capped by what the device sets aside and
    takes in one window, and by the pack."""
    want = max_persisting if requested.strip().lower() == "max" else int(float(requested) * 2**20)
    return max(0, min(want, max_persisting, max_window, packed))


class L2Residency:
    """The pack of a model's depth weights, the L2 set aside for them, and the window kernel nodes get."""

    def __init__(self, flat: Tensor, num_bytes: int) -> None:
        self.flat, self.num_bytes = flat, num_bytes
        self.value = AttrValue()
        self.value.window = Window(flat.data_ptr(), num_bytes, 1.0, PERSISTING, NORMAL)
        torch.cuda.synchronize(flat.device)  # the runtime has made the primary context current on this thread
        check(driver().cuCtxSetLimit(_LIMIT_PERSISTING_L2, ctypes.c_size_t(num_bytes)), "cuCtxSetLimit")

    @classmethod
    def for_model(cls, model: CSMModel, requested: str | None = None) -> L2Residency | None:
        """Packs the model's depth weights and sets L2 aside for the first CSMSERVE_L2_RESIDENT_MB of them; None
        where that is 0 or the device has no persisting L2 (the CPU, before sm80)."""
        requested = requested if requested is not None else os.environ.get("CSMSERVE_L2_RESIDENT_MB", DEFAULT_MB)
        device = next(model.parameters()).device
        if device.type != "cuda" or requested.strip() in ("", "0"):
            return None
        max_persisting = device_attribute(_ATTR_MAX_PERSISTING_L2, device)
        max_window = device_attribute(_ATTR_MAX_WINDOW, device)
        if max_persisting <= 0 or max_window <= 0:
            return None
        flat = pack(depth_weights(model), device, getattr(model, "l2_pack", None))
        model.l2_pack = flat  # the pack lives as long as the model: graphs of every runner on it read it
        n = window_bytes(requested, max_persisting, max_window, len(flat))
        if n <= 0:
            return None
        try:
            return cls(flat, n)
        except RuntimeError as e:  # a driver that refuses the set-aside (MIG, say): serve without it
            warnings.warn(f"L2 residency off: {e}")
            return None

    def apply(self, graph: int) -> int:
        """The window on every kernel node of a cudaGraph_t (before instantiation); returns how many."""
        nodes = kernel_nodes(graph)
        for node in nodes:
            check(driver().cuGraphKernelNodeSetAttribute(node, _ACCESS_POLICY_WINDOW, ctypes.byref(self.value)),
                  "cuGraphKernelNodeSetAttribute")
        return len(nodes)

    def __repr__(self) -> str:
        return f"L2Residency(window {self.num_bytes / 2**20:.1f} of {len(self.flat) / 2**20:.1f} MB packed)"


def kernel_nodes(graph: int) -> list[ctypes.c_void_p]:
    """The kernel nodes of a cudaGraph_t (torch's CUDAGraph.raw_cuda_graph())."""
    lib, count = driver(), ctypes.c_size_t()
    check(lib.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    check(lib.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(count)), "cuGraphGetNodes")
    out, kind = [], ctypes.c_int()
    for node in nodes:
        check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == _NODE_KERNEL:
            out.append(ctypes.c_void_p(node))
    return out


def node_windows(graph: int) -> list[tuple[int, int, float, int]]:
    """(base, bytes, hit ratio, hit property) of every kernel node's window in a cudaGraph_t: for the tests."""
    out = []
    for node in kernel_nodes(graph):
        v = AttrValue()
        check(driver().cuGraphKernelNodeGetAttribute(node, _ACCESS_POLICY_WINDOW, ctypes.byref(v)),
              "cuGraphKernelNodeGetAttribute")
        out.append((v.window.base_ptr or 0, v.window.num_bytes, v.window.hitRatio, v.window.hitProp))
    return out
