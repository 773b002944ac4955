"""One place that turns a failed Vulkan call into an error naming the VkResult and the call."""
import vulkan as vk

# VkResult code -> its spec name (VK_ERROR_OUT_OF_DEVICE_MEMORY, ...), read off the binding.
_RESULT_NAMES = {getattr(vk, n): n for n in dir(vk)
                 if n.startswith(("VK_ERROR_", "VK_NOT_READY", "VK_TIMEOUT", "VK_INCOMPLETE"))
                 and isinstance(getattr(vk, n), int)}
_CODE_OF_CLASS = {cls: code for code, cls in vk.exception_codes.items() if code is not None}


class VulkanError(RuntimeError):
    """A Vulkan call failed; `result` is the VkResult name, `call` the function."""

    def __init__(self, call: str, result: str, detail: str = ""):
        self.call, self.result = call, result
        super().__init__(f"{call} failed with {result}" + (f": {detail}" if detail else ""))


class DeviceNotFound(LookupError):
    """The user asked for a device that is not present."""


def result_name(code: int) -> str:
    return _RESULT_NAMES.get(code, f"VkResult({code})")


def vkcall(fn, *args, detail: str = ""):
    """Call a binding function; on failure raise VulkanError naming the VkResult and the call."""
    try:
        return fn(*args)
    except (vk.VkException, vk.VkError) as e:
        raise VulkanError(getattr(fn, "__name__", str(fn)),
                          result_name(_CODE_OF_CLASS.get(type(e), -13)), detail) from None


def check(code: int, call: str, detail: str = ""):
    """For raw `vk.lib` calls that return a VkResult integer."""
    if code != vk.VK_SUCCESS:
        raise VulkanError(call, result_name(code), detail)


class DeviceMemoryError(ValueError):
    """An allocation (or a model) that does not fit the device's memory budget, refused before
    anything is allocated; names the bytes needed and left."""
