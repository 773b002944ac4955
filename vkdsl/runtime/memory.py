"""Device buffers. Unified-memory devices (CPU drivers, integrated GPUs) get host-mapped
device memory; discrete GPUs get device-local memory reached through staging copies."""
from __future__ import annotations

import weakref

import numpy as np
import vulkan as vk

from .commands import Recording
from .errors import VulkanError, vkcall

_USAGE = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_UNIFORM_TEXEL_BUFFER_BIT |
          vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
# Read-only views a kernel may bind instead of a storage buffer (GLSL samplerBuffer /
# usamplerBuffer):
# name -> (VkFormat, bytes per texel). On lavapipe a texelFetch is a vector gather while a storage
# buffer load is a branchy loop over the SIMD lanes, ~18x slower per vec4 (BENCHMARKS.md).
TEXEL_FORMATS = {"r32f": (vk.VK_FORMAT_R32_SFLOAT, 4),
                 "rgba32f": (vk.VK_FORMAT_R32G32B32A32_SFLOAT, 16),
                 "r32ui": (vk.VK_FORMAT_R32_UINT, 4), "rg32ui": (vk.VK_FORMAT_R32G32_UINT, 8),
                 "rgba32ui": (vk.VK_FORMAT_R32G32B32A32_UINT, 16)}
HOST = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
LOCAL = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT


def _memory_type(device, type_bits: int, want: int, prefer: int = 0) -> int:
    mp = device.memory_properties
    ok = [i for i in range(mp.memoryTypeCount)
          if type_bits & (1 << i) and (mp.memoryTypes[i].propertyFlags & want) == want]
    if not ok:
        raise VulkanError("vkAllocateMemory", "no suitable memory type",
                          f"{device.info.name} has no memory type with flags {want:#x}")
    return max(ok, key=lambda i: (mp.memoryTypes[i].propertyFlags & prefer) == prefer)


def _release(dev_handle, buf, mem, device, nbytes, views):
    for v in views.values():
        vk.vkDestroyBufferView(dev_handle, v, None)
    vk.vkDestroyBuffer(dev_handle, buf, None)
    vk.vkFreeMemory(dev_handle, mem, None)
    device.allocated_bytes -= nbytes


class Part:
    """The first `nbytes` of a larger buffer: what one value of a program sees of a slot it shares
    with larger values (vkdsl.slots.buffer_slots), so sizes taken from a bound buffer are the
    value's. Binding, copies, barriers and texel views go to the whole buffer."""
    __slots__ = ("buffer", "nbytes")

    def __init__(self, buffer: "Buffer", nbytes: int):
        self.buffer, self.nbytes = buffer, int(nbytes)

    def __getattr__(self, name):
        return getattr(self.buffer, name)


def key_stable_size(nbytes: int) -> int:
    """The bytes to allocate for nbytes (>= 16: Vulkan forbids empty buffers). llvmpipe compiles
    a shader once per variant, and a texel buffer's variant key holds two bits of its buffer's
    size: whether the size is a power of two, and whether bits 8-15 of the view's size are all
    zero (a field of the view that shares those bits). Allocating a size that is never a power of
    two and always has one of bits 8-15 set (<= 272 bytes more) keeps one variant per kernel, not
    one per shape: the first run on a machine compiles each kernel once."""
    size = -(-max(nbytes, 16) // 16) * 16
    if size & (size - 1) == 0:
        size += 16
    if (size >> 8) & 0xFF == 0:
        size += 256
    return size


class Buffer:
    """A VkBuffer with its own memory. `host` buffers are mapped for the life of the buffer."""

    def __init__(self, device, nbytes: int, host: bool | None = None, label: str = ""):
        self.device, self.nbytes, self.label = device, int(nbytes), label
        self.host = device.unified_memory if host is None else host
        size = key_stable_size(self.nbytes)
        if size > device.limits.max_storage_buffer_range:   # the padding never costs a binding
            size = max(self.nbytes, 16)
        if size > device.limits.max_storage_buffer_range and not host:
            raise ValueError(f"buffer {label or ''} of {size} bytes exceeds the device's "
                             f"maxStorageBufferRange of "
                             f"{device.limits.max_storage_buffer_range} bytes")
        if host is not True:                  # staging buffers are transient host memory
            device.reserve(size, f"buffer {label or ''}".strip())
        h = device.handle
        self.handle = vkcall(vk.vkCreateBuffer, h, vk.VkBufferCreateInfo(
            size=size, usage=_USAGE, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
        req = vk.vkGetBufferMemoryRequirements(h, self.handle)
        want = HOST if self.host else LOCAL
        prefer = (vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT | LOCAL) if self.host else 0
        mtype = _memory_type(device, req.memoryTypeBits, want, prefer)
        self.memory = vkcall(vk.vkAllocateMemory, h, vk.VkMemoryAllocateInfo(
            allocationSize=req.size, memoryTypeIndex=mtype), None,
            detail=f"allocating {req.size} bytes for {label or 'a buffer'}")
        vkcall(vk.vkBindBufferMemory, h, self.handle, self.memory, 0)
        device.allocated_bytes += req.size
        device.peak_bytes = max(device.peak_bytes, device.allocated_bytes)
        self._mapped = vkcall(vk.vkMapMemory, h, self.memory, 0, size, 0) if self.host else None
        self._size, self._views = size, {}
        self._finalizer = weakref.finalize(self, _release, h, self.handle, self.memory, device,
                                           req.size, self._views)

    def texel_view(self, fmt: str):
        """A uniform-texel-buffer view of the whole buffer (as many texels as fit), made once."""
        if fmt not in self._views:
            vkfmt, size = TEXEL_FORMATS[fmt]
            texels = min(self._size // size, self.device.limits.max_texel_elements)
            self._views[fmt] = vkcall(vk.vkCreateBufferView, self.device.handle,
                                      vk.VkBufferViewCreateInfo(
                buffer=self.handle, format=vkfmt, offset=0, range=texels * size), None,
                detail=f"a {fmt} view of {self.label or 'a buffer'}")
        return self._views[fmt]

    def view(self, dtype=np.uint8, count: int | None = None) -> np.ndarray:
        """Zero-copy numpy view of a host-mapped buffer."""
        if self._mapped is None:
            raise ValueError("view() needs a host-visible buffer; use read()")
        return np.frombuffer(self._mapped, dtype=dtype, count=count if count is not None else
                             self.nbytes // np.dtype(dtype).itemsize)

    def write(self, data: np.ndarray, offset: int = 0):
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if offset + raw.nbytes > self.nbytes:
            raise ValueError(f"writing {raw.nbytes} bytes at offset {offset} into a "
                             f"{self.nbytes}-byte buffer")
        if self.host:
            self.view()[offset:offset + raw.nbytes] = raw
            return
        stage = Buffer(self.device, raw.nbytes, host=True, label="staging")
        stage.view()[:raw.nbytes] = raw
        _copy_now(stage, self, raw.nbytes, offset)
        stage.free()

    def read(self, dtype=np.float32, count: int | None = None) -> np.ndarray:
        count = self.nbytes // np.dtype(dtype).itemsize if count is None else count
        if self.host:
            return self.view(dtype, count).copy()
        nbytes = count * np.dtype(dtype).itemsize
        stage = Buffer(self.device, max(nbytes, 4), host=True, label="staging")
        _copy_now(self, stage, nbytes)
        out = stage.view()[:nbytes].copy().view(dtype)
        stage.free()
        return out

    def free(self):
        self._mapped = None
        self._finalizer()

    def __repr__(self):
        return (f"Buffer({self.label or '?'}, {self.nbytes} B, "
                f"{'host' if self.host else 'device-local'})")


def _copy_now(src: Buffer, dst: Buffer, nbytes: int, dst_offset: int = 0):
    """A staging copy through the same command path as every recording: record, submit, wait."""
    rec = Recording(src.device, 1, label="staging")
    rec.copy(src, dst, nbytes, dst_offset)
    rec.submit_wait()
    rec.release()
