"""An opened Vulkan device: logical device, one compute queue, pools, and the process default."""
from __future__ import annotations

import os
import sys
from collections import defaultdict

import vulkan as vk

from .device import DeviceInfo, instance, select
from .profiles import apply, named
from .errors import DeviceMemoryError, VulkanError, vkcall
from .pipeline_cache import PipelineCache

# callables that free device memory held only as a cache (vkdsl.trace: programs of shapes not in
# use), each returning whether it freed anything; an allocation over the budget calls them first
RECLAIM: list = []


class Device:
    """Logical device with one compute queue. Kernels and buffers are created against it."""

    def __init__(self, info: DeviceInfo):
        self.info, self.limits = info, info.limits
        pd = info.handle
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(pd)
        # Prefer a compute-only family (async compute on GPUs); any compute family will do.
        compute = [i for i, f in enumerate(families) if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
        if not compute:
            raise VulkanError("vkGetPhysicalDeviceQueueFamilyProperties", "no compute queue",
                              f"{info.describe()} exposes no compute-capable queue family")
        only = [i for i in compute if not families[i].queueFlags & vk.VK_QUEUE_GRAPHICS_BIT]
        self.queue_family = (only or compute)[0]
        qinfo = vk.VkDeviceQueueCreateInfo(queueFamilyIndex=self.queue_family, queueCount=1,
                                          pQueuePriorities=[1.0])
        # Ask only for the optional features the device has; kernels check self.limits first.
        s16 = vk.VkPhysicalDevice16BitStorageFeatures(
            storageBuffer16BitAccess=int(info.limits.storage16))
        f16 = vk.VkPhysicalDeviceShaderFloat16Int8Features(
            pNext=s16, shaderFloat16=int(info.limits.float16), shaderInt8=int(info.limits.int8))
        s8 = vk.VkPhysicalDevice8BitStorageFeatures(pNext=f16,
                                                    storageBuffer8BitAccess=int(info.limits.int8))
        chain, extensions = s8, []
        # the cooperative-matrix matmul (vkdsl.matmul, variant coop)
        if info.limits.cooperative_matrix:
            coop = vk.VkPhysicalDeviceCooperativeMatrixFeaturesKHR(
                sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR,
                pNext=s8, cooperativeMatrix=1)
            chain = vk.VkPhysicalDeviceVulkanMemoryModelFeatures(pNext=coop, vulkanMemoryModel=1)
            extensions = ["VK_KHR_cooperative_matrix"]
        core = vk.VkPhysicalDeviceFeatures2(pNext=chain, features=vk.VkPhysicalDeviceFeatures(
            shaderInt64=int(info.limits.int64)))
        create = vk.VkDeviceCreateInfo(pNext=core, queueCreateInfoCount=1,
                                       pQueueCreateInfos=[qinfo],
                                       enabledExtensionCount=len(extensions),
                                       ppEnabledExtensionNames=extensions)
        self.handle = vkcall(vk.vkCreateDevice, pd, create, None)
        self.queue = vk.vkGetDeviceQueue(self.handle, self.queue_family, 0)
        self.command_pool = vkcall(vk.vkCreateCommandPool, self.handle, vk.VkCommandPoolCreateInfo(
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
            queueFamilyIndex=self.queue_family), None)
        self.memory_properties = vk.vkGetPhysicalDeviceMemoryProperties(pd)
        # (spirv digest, binding count, push size, ...) -> Kernel, built once
        self.kernels = {}
        self.pipeline_cache = PipelineCache(self)      # the driver's, kept on disk between runs
        self.allocated_bytes = 0   # live device memory, for memory-honesty reports
        self.peak_bytes = 0
        # seconds in submit + wait per program label: the device's work as the host sees it
        self.waited = defaultdict(float)

    @property
    def memory_budget(self) -> int:
        """Bytes vkdsl may allocate: the largest device-local heap, or $VKDSL_DEVICE_MEMORY_LIMIT
        (bytes; K/M/G suffixes) when that is smaller."""
        heap = max((b for b, local in self.info.heaps if local),
                   default=max(b for b, _ in self.info.heaps))
        limit = os.environ.get("VKDSL_DEVICE_MEMORY_LIMIT")
        return min(heap, parse_bytes(limit)) if limit else heap

    def reserve(self, nbytes: int, what: str):
        """Refuse, before allocating, an allocation that would pass the budget (what RECLAIM can
        free given up first)."""
        while (self.allocated_bytes + nbytes > self.memory_budget
               and any(free() for free in RECLAIM)):
            pass
        if self.allocated_bytes + nbytes > self.memory_budget:
            raise DeviceMemoryError(
                f"{what} needs {nbytes / 2**20:.1f} MiB of device memory; {self.info.name} has "
                f"{(self.memory_budget - self.allocated_bytes) / 2**20:.1f} MiB left of a "
                f"{self.memory_budget / 2**20:.1f} MiB budget")

    @property
    def unified_memory(self) -> bool:
        return self.info.host_visible_device_local

    def wait_idle(self):
        vkcall(vk.vkDeviceWaitIdle, self.handle)

    def __repr__(self):
        return f"Device({self.info.describe()})"


def parse_bytes(text: str) -> int:
    """'512M', '2G', '1048576' -> bytes (binary units)."""
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if mult > 1 else t) * mult)
    except (ValueError, OverflowError):
        n = 0
    if n <= 0:
        raise ValueError(f"VKDSL_DEVICE_MEMORY_LIMIT={text!r}: expected a positive number of "
                         f"bytes, e.g. 512M or 2G")
    return n


_default: Device | None = None


def open_device(spec=None, announce: bool = False) -> Device:
    """Open (once per process) the device named by spec / $VKDSL_DEVICE / the best present."""
    global _default
    if _default is not None and spec is None:
        return _default
    info = apply(select(spec), named())          # $VKDSL_PROFILE: as if narrower (runtime.profiles)
    if _default is not None and _default.info.index == info.index:
        return _default
    if _default is not None:
        raise RuntimeError(f"vkdsl already runs on {_default.info.describe()}; one device "
                           f"per process")
    instance()
    _default = Device(info)
    if announce:
        print(f"vkdsl: using {info.describe()}", file=sys.stderr)
    return _default


def default_device() -> Device:
    return open_device(None)
