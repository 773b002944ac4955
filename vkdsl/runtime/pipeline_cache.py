"""The driver's pipeline cache, kept on disk between runs. Drivers that keep no cache of their own
(many mobile ones) otherwise rebuild every pipeline in every process; lavapipe and NVIDIA keep
their own and hand back only the 32-byte header, so nothing is written for them.

One file per device and driver build (vendor, device, driver version, pipelineCacheUUID) under
the SPIR-V cache folder. The header the Vulkan spec defines is checked before the driver sees the
data: a file from another driver, or a damaged one, is said in one line and rebuilt, never used."""
from __future__ import annotations

import atexit
import os
import struct
import sys
import weakref

import vulkan as vk

from ..fileio import atomic_write
from .errors import vkcall

HEADER = struct.Struct("<IIII16s")     # header length, version (1 = ONE), vendorID, deviceID, UUID


def _identity(pd) -> tuple[int, int, int, bytes]:
    p = vk.vkGetPhysicalDeviceProperties(pd)
    return p.vendorID, p.deviceID, p.driverVersion, bytes(p.pipelineCacheUUID)


def cache_path(pd, part: str = "") -> str:
    from ..compiler.cache import cache_dir
    vendor, device, driver, uuid = _identity(pd)
    return os.path.join(cache_dir(), "pipelines", f"{vendor:04x}-{device:04x}-{driver:08x}-"
                        f"{uuid.hex()}{'-' + part if part else ''}.bin")


def load(pd, part: str = "") -> bytes:
    """The saved cache for this device and driver, or b"" (none yet, or not usable: said once)."""
    path = cache_path(pd, part)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return b""
    except OSError as e:
        print(f"vkdsl: cannot read the pipeline cache {path} ({e}); building pipelines afresh",
              file=sys.stderr)
        return b""
    vendor, device, _, uuid = _identity(pd)
    head = HEADER.unpack_from(data) if len(data) >= HEADER.size else None
    if (head is None or head[0] < HEADER.size or head[0] > len(data)
        or head[1:] != (1, vendor, device, uuid)):
        print(f"vkdsl: pipeline cache {path} is damaged or from another driver; rebuilding it",
              file=sys.stderr)
        return b""
    return data


class PipelineCache:
    """A VkPipelineCache seeded from disk; written back at exit when the driver put pipelines in
    it. part: a file of its own, for a process that runs beside another on the same device (the
    run's verify pass), so that neither replaces the pipelines the other saved."""

    def __init__(self, device, part: str = ""):
        pd = device.info.handle
        self.path, data = cache_path(pd, part), load(pd, part)
        self._seeded = len(data)
        info = vk.VkPipelineCacheCreateInfo(initialDataSize=len(data),
                                            pInitialData=vk.ffi.from_buffer(data) if data
                                            else vk.ffi.NULL)
        self.handle = vkcall(vk.vkCreatePipelineCache, device.handle, info, None)
        ref = weakref.ref(device)
        atexit.register(lambda: ref() is not None and self.save(ref()))

    def data(self, device) -> bytes:
        n = vk.ffi.new("size_t*")
        if vk.lib.vkGetPipelineCacheData(device.handle, self.handle, n,
                                         vk.ffi.NULL) != vk.VK_SUCCESS:
            return b""
        buf = vk.ffi.new("char[]", n[0])
        if vk.lib.vkGetPipelineCacheData(device.handle, self.handle, n, buf) != vk.VK_SUCCESS:
            return b""
        return bytes(vk.ffi.buffer(buf, n[0]))

    def save(self, device):
        data = self.data(device)
        # nothing the driver keeps, or nothing new
        if len(data) <= HEADER.size or len(data) == self._seeded:
            return
        try:
            atomic_write(self.path, data)
        except OSError as e:                 # a read-only home must not stop the run
            print(f"vkdsl: cannot write the pipeline cache ({e}); continuing without it",
                  file=sys.stderr)
