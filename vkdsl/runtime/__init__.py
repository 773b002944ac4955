"""Vulkan runtime: devices, memory, kernels (pipelines) and recorded command buffers."""
from .commands import Recording
from .context import Device, default_device, open_device
from .device import DeviceInfo, list_devices, select
from .errors import DeviceMemoryError, DeviceNotFound, VulkanError
from .kernel import Kernel, get_kernel
from .memory import Buffer, Part

__all__ = ["Recording", "Device", "default_device", "open_device", "DeviceInfo", "list_devices",
           "select", "DeviceMemoryError", "DeviceNotFound", "VulkanError", "Kernel", "get_kernel",
           "Buffer", "Part"]
