"""Find Vulkan devices, describe them, and open the one the user asked for."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import vulkan as vk

from .errors import DeviceNotFound, VulkanError, vkcall

_TYPE_NAMES = {vk.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: "discrete",
               vk.VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: "integrated",
               vk.VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: "virtual",
               vk.VK_PHYSICAL_DEVICE_TYPE_CPU: "cpu",
               vk.VK_PHYSICAL_DEVICE_TYPE_OTHER: "other"}
# Default preference when the user names no device: real GPUs first, the CPU driver last.
_PREFERENCE = ["discrete", "integrated", "virtual", "other", "cpu"]


@dataclass(frozen=True)
class Limits:
    max_storage_buffer_range: int
    max_workgroup_size: tuple[int, int, int]
    max_workgroup_invocations: int
    max_workgroup_count: tuple[int, int, int]
    max_shared_memory: int
    max_push_constants: int
    subgroup_size: int
    float16: bool            # shaderFloat16: arithmetic in f16
    storage16: bool          # storageBuffer16BitAccess: f16 values in storage buffers
    int8: bool
    int64: bool              # shaderInt64: 64-bit integer types (the 8-float matmul loads)
    subgroup_arithmetic: bool = False   # subgroupAdd/Max/... in compute shaders
    # VK_KHR_cooperative_matrix with an fp16 x fp16 + fp32 subgroup shape
    cooperative_matrix: bool = False
    coopmat_shapes: tuple = ()          # ((M, N, K), ...) of those shapes, as the driver lists them
    # uniform texel buffers (r32 / rgba32, float and uint); 0: none
    max_texel_elements: int = 0


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    kind: str                # discrete | integrated | virtual | cpu | other
    driver: str
    driver_info: str
    api_version: str
    heaps: tuple             # ((bytes, device_local), ...)
    host_visible_device_local: bool   # can the host map device-local memory directly?
    limits: Limits
    handle: object = field(repr=False, compare=False, default=None)
    profile: str = ""        # the capability profile it is seen through (runtime.profiles), if any
    variant: str = ""        # the kernel family that profile asks for ("" = the device's own)

    def describe(self) -> str:
        return (f"[{self.index}] {self.name} ({self.kind}; {self.driver} {self.driver_info})"
                + (f" as profile {self.profile}" if self.profile else ""))


def _version(v: int) -> str:
    return f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


def _texel_formats(pd) -> bool:
    """Whether every format of runtime.memory.TEXEL_FORMATS can back a uniform texel buffer (the
    spec requires it; a driver that says otherwise gets storage-buffer kernels only)."""
    from .memory import TEXEL_FORMATS
    return all(vk.vkGetPhysicalDeviceFormatProperties(pd, f).bufferFeatures
               & vk.VK_FORMAT_FEATURE_UNIFORM_TEXEL_BUFFER_BIT for f, _ in TEXEL_FORMATS.values())


def _info(index: int, pd) -> DeviceInfo:
    props = vk.vkGetPhysicalDeviceProperties(pd)
    sub = vk.VkPhysicalDeviceSubgroupProperties()
    drv = vk.VkPhysicalDeviceVulkan12Properties(pNext=sub)
    vk.vkGetPhysicalDeviceProperties2(pd, vk.VkPhysicalDeviceProperties2(pNext=drv))
    s16 = vk.VkPhysicalDevice16BitStorageFeatures()
    f16 = vk.VkPhysicalDeviceShaderFloat16Int8Features(pNext=s16)
    vk.vkGetPhysicalDeviceFeatures2(pd, vk.VkPhysicalDeviceFeatures2(pNext=f16))
    mem = vk.vkGetPhysicalDeviceMemoryProperties(pd)
    heaps = tuple((mem.memoryHeaps[i].size,
                   bool(mem.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT))
                  for i in range(mem.memoryHeapCount))
    want = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT | vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
    # Unified memory: the largest device-local heap is host-mappable (CPU drivers, integrated
    # GPUs). A small host-visible window (a discrete GPU's 256 MiB BAR) does not count.
    big = max(range(mem.memoryHeapCount), key=lambda i: (heaps[i][1], heaps[i][0]))
    unified = any((mem.memoryTypes[i].propertyFlags & want) == want
                  and mem.memoryTypes[i].heapIndex == big
                  for i in range(mem.memoryTypeCount))
    L = props.limits
    coop = (_coopmat_shapes(pd) if "VK_KHR_cooperative_matrix" in _extensions(pd)
            and f16.shaderFloat16 else ())
    limits = Limits(
        max_storage_buffer_range=L.maxStorageBufferRange,
        max_workgroup_size=tuple(L.maxComputeWorkGroupSize),
        max_workgroup_invocations=L.maxComputeWorkGroupInvocations,
        max_workgroup_count=tuple(L.maxComputeWorkGroupCount),
        max_shared_memory=L.maxComputeSharedMemorySize,
        max_push_constants=L.maxPushConstantsSize,
        subgroup_size=sub.subgroupSize,
        float16=bool(f16.shaderFloat16), storage16=bool(s16.storageBuffer16BitAccess),
        int8=bool(f16.shaderInt8), int64=bool(vk.vkGetPhysicalDeviceFeatures(pd).shaderInt64),
        subgroup_arithmetic=bool(sub.supportedOperations & vk.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT
                                 and sub.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT),
        cooperative_matrix=bool(coop), coopmat_shapes=coop,
        max_texel_elements=L.maxTexelBufferElements if _texel_formats(pd) else 0)
    return DeviceInfo(index=index, name=props.deviceName,
                      kind=_TYPE_NAMES.get(props.deviceType, "other"),
                      driver=vk.ffi.string(drv.driverName).decode(errors="replace"),
                      # SwiftShader leaves driverInfo empty: its packed driverVersion says it
                      driver_info=(vk.ffi.string(drv.driverInfo).decode(errors="replace")
                                   or f"version {_version(props.driverVersion)}"),
                      api_version=_version(props.apiVersion), heaps=heaps,
                      host_visible_device_local=unified, limits=limits, handle=pd)


def _coopmat_shapes(pd) -> tuple:
    """(M, N, K) of the subgroup-scope cooperative matrices with fp16 A and B and fp32 C and result
    that the device lists and can run (the cooperativeMatrix and vulkanMemoryModel features)."""
    feats = vk.VkPhysicalDeviceCooperativeMatrixFeaturesKHR(
        sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR)
    model = vk.VkPhysicalDeviceVulkanMemoryModelFeatures(pNext=feats)
    vk.vkGetPhysicalDeviceFeatures2(pd, vk.VkPhysicalDeviceFeatures2(pNext=model))
    if not (feats.cooperativeMatrix and model.vulkanMemoryModel):
        return ()
    name = b"vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"
    raw = vk.lib.vkGetInstanceProcAddr(instance(), name)
    if raw == vk.ffi.NULL:
        return ()
    fn = vk.ffi.cast("PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR", raw)
    n = vk.ffi.new("uint32_t*")
    if fn(pd, n, vk.ffi.NULL) != vk.VK_SUCCESS:
        return ()
    props = vk.ffi.new("VkCooperativeMatrixPropertiesKHR[]", n[0])
    for i in range(n[0]):
        props[i].sType = vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
    if fn(pd, n, props) != vk.VK_SUCCESS:
        return ()
    f16, f32 = vk.VK_COMPONENT_TYPE_FLOAT16_KHR, vk.VK_COMPONENT_TYPE_FLOAT32_KHR
    return tuple(sorted({(p.MSize, p.NSize, p.KSize) for p in props[0:n[0]]
                         if (p.AType, p.BType, p.CType, p.ResultType) == (f16, f16, f32, f32)
                         and p.scope == vk.VK_SCOPE_SUBGROUP_KHR and not p.saturatingAccumulation}))


def _extensions(pd) -> set:
    return {e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(pd, None)}


_instance = None
VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"


def _validation_request():
    """$VKDSL_VALIDATION: unset/0 none; 1 the Khronos validation layer; sync the layer with
    synchronization validation (hazards between dispatches). Messages go to stdout."""
    mode = os.environ.get("VKDSL_VALIDATION", "0").strip().lower()
    if mode in ("", "0"):
        return None
    if mode not in ("1", "sync"):
        raise ValueError(f"VKDSL_VALIDATION={mode!r}: expected 0, 1 or sync")
    present = {p.layerName for p in vk.vkEnumerateInstanceLayerProperties()}
    if VALIDATION_LAYER not in present:
        raise VulkanError("vkCreateInstance", "validation layer missing",
                          f"VKDSL_VALIDATION is set but {VALIDATION_LAYER} is not installed "
                          f"(Debian: vulkan-validationlayers)")
    return mode


def icd_problems() -> str:
    """What is wrong with the driver files $VK_ICD_FILENAMES / $VK_DRIVER_FILES name ('' when
    nothing is, or when neither is set): a missing or unreadable file, or a library_path that is not
    there."""
    import json
    names = os.environ.get("VK_DRIVER_FILES") or os.environ.get("VK_ICD_FILENAMES") or ""
    bad = []
    for name in filter(None, names.split(os.pathsep)):
        try:
            lib = json.loads(open(name).read())["ICD"]["library_path"]
        except OSError as e:
            bad.append(f"{name}: {e.strerror}")
            continue
        except (ValueError, KeyError, TypeError):
            bad.append(f"{name}: not a Vulkan ICD file (expected JSON with ICD.library_path)")
            continue
        path = (lib if os.path.isabs(lib)
                else os.path.join(os.path.dirname(os.path.abspath(name)), lib))
        if ("/" in lib or os.path.isabs(lib)) and not os.path.exists(path):
            bad.append(f"{name}: its library_path {lib} does not exist")
    return "; ".join(bad)


def instance():
    """The process-wide VkInstance (Vulkan 1.2: we need its driver-properties query)."""
    global _instance
    if _instance is None:
        app = vk.VkApplicationInfo(pApplicationName="vkdsl", applicationVersion=1,
                                   pEngineName="vkdsl", engineVersion=1,
                                   apiVersion=vk.VK_MAKE_VERSION(1, 2, 0))
        mode, extra = _validation_request(), {}
        if mode:
            extra = dict(enabledLayerCount=1, ppEnabledLayerNames=[VALIDATION_LAYER])
            if mode == "sync":
                extra["pNext"] = vk.VkValidationFeaturesEXT(
                    enabledValidationFeatureCount=1,
                    pEnabledValidationFeatures=[
                        vk.VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT])
        _instance = vkcall(vk.vkCreateInstance,
                           vk.VkInstanceCreateInfo(pApplicationInfo=app, **extra), None,
                           detail=icd_problems()
                           or "is a Vulkan driver installed (mesa-vulkan-drivers for the CPU)?")
        skipped = icd_problems()      # the loader passes over a broken file when another works
        if skipped:
            print(f"vkdsl: warning: a Vulkan driver file was skipped: {skipped}", file=sys.stderr)
    return _instance


def list_devices() -> list[DeviceInfo]:
    return [_info(i, pd) for i, pd in enumerate(vkcall(vk.vkEnumeratePhysicalDevices, instance()))]


def ranked_devices() -> list[DeviceInfo]:
    """The devices of the most preferred kind present, by index (one per rank of a parallel job)."""
    devices = list_devices()
    if not devices:
        return []
    best = min(_PREFERENCE.index(d.kind) for d in devices)
    return [d for d in devices if _PREFERENCE.index(d.kind) == best]


def select(spec: str | int | None = None) -> DeviceInfo:
    """Pick a device by index or name substring; None means $VKDSL_DEVICE, else the best present.

    A device the user asked for that is not there is an error listing what is there:
    silently falling back to the CPU would hide a broken GPU setup."""
    devices = list_devices()
    if not devices:
        raise DeviceNotFound("no Vulkan device found (install a driver, e.g. mesa-vulkan-drivers)")
    if spec is None or spec == "":
        spec = os.environ.get("VKDSL_DEVICE") or None
    if spec is None:
        # among CPU drivers lavapipe first: SwiftShader runs these kernels about 30x slower
        return min(devices, key=lambda d: (_PREFERENCE.index(d.kind), "SwiftShader" in d.name,
                                           d.index))
    listing = "\n  ".join(d.describe() for d in devices)
    s = str(spec).strip()
    if s.isdigit():
        if int(s) < len(devices):
            return devices[int(s)]
        raise DeviceNotFound(f"device index {s} does not exist; devices present:\n  {listing}")
    hits = [d for d in devices if s.lower() in d.name.lower() or s.lower() == d.kind]
    if not hits:
        raise DeviceNotFound(f"no device matches {s!r}; devices present:\n  {listing}")
    return hits[0]
