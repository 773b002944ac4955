"""A compute pipeline built from SPIR-V: N buffer bindings (storage buffers, or uniform texel
buffers where `texels` names a binding's format) and an optional push-constant block."""
from __future__ import annotations

import hashlib

import vulkan as vk

from .errors import vkcall
from .spirv_limits import refuse_beyond, workgroup_beyond


class Kernel:
    def __init__(self, device, name: str, spirv: bytes, n_buffers: int, push_size: int = 0,
                 local_size: tuple[int, int, int] = (64, 1, 1), texels: tuple = ()):
        if push_size > device.limits.max_push_constants:
            raise ValueError(f"kernel {name}: {push_size} bytes of push constants exceed "
                             f"the device limit of {device.limits.max_push_constants}")
        if workgroup_beyond(local_size, device.limits):
            raise ValueError(f"kernel {name}: workgroup {local_size} exceeds the device limits "
                             f"{device.limits.max_workgroup_size} / "
                             f"{device.limits.max_workgroup_invocations}")
        refuse_beyond(name, spirv, device.limits)       # sizes written into the shader itself
        self.device, self.name, self.n_buffers, self.push_size = device, name, n_buffers, push_size
        self.local_size, self.texels = local_size, dict(texels)     # binding -> texel format
        h = device.handle
        self.module = vkcall(vk.vkCreateShaderModule, h, vk.VkShaderModuleCreateInfo(
            codeSize=len(spirv), pCode=spirv), None, detail=f"kernel {name}")
        bindings = [vk.VkDescriptorSetLayoutBinding(binding=i,
                                                    descriptorType=descriptor_type(self, i),
                                                    descriptorCount=1,
                                                    stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT)
                    for i in range(n_buffers)]
        self.set_layout = vkcall(vk.vkCreateDescriptorSetLayout, h,
                                 vk.VkDescriptorSetLayoutCreateInfo(
            bindingCount=n_buffers, pBindings=bindings), None)
        ranges = [vk.VkPushConstantRange(stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0,
                                         size=push_size)] \
            if push_size else []
        self.layout = vkcall(vk.vkCreatePipelineLayout, h, vk.VkPipelineLayoutCreateInfo(
            setLayoutCount=1, pSetLayouts=[self.set_layout], pushConstantRangeCount=len(ranges),
            pPushConstantRanges=ranges or None), None)
        # Local size travels as specialization constants 0..2 (GLSL: local_size_x_id = 0, ...),
        # so one SPIR-V module serves the workgroup shape chosen for each device.
        entries = [vk.VkSpecializationMapEntry(constantID=i, offset=4 * i, size=4)
                   for i in range(3)]
        data = vk.ffi.new("uint32_t[3]", list(local_size))
        spec = vk.VkSpecializationInfo(mapEntryCount=3, pMapEntries=entries, dataSize=12,
                                       pData=vk.ffi.cast("void*", data))
        stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT,
                                                   module=self.module, pName="main",
                                                   pSpecializationInfo=spec)
        self.pipeline = vkcall(vk.vkCreateComputePipelines, h, device.pipeline_cache.handle, 1,
                               [vk.VkComputePipelineCreateInfo(stage=stage, layout=self.layout)],
                               None, detail=f"kernel {name}")[0]

    def __repr__(self):
        return f"Kernel({self.name}, {self.n_buffers} buffers, {self.push_size} B push)"


def descriptor_type(kernel, binding: int):
    return (vk.VK_DESCRIPTOR_TYPE_UNIFORM_TEXEL_BUFFER if binding in kernel.texels
            else vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER)


def get_kernel(device, name: str, spirv: bytes, n_buffers: int, push_size: int = 0,
               local_size=(64, 1, 1), texels: tuple = ()) -> Kernel:
    """Pipelines are expensive on CPU drivers (LLVM compiles each): build each one once."""
    texels = tuple(sorted(dict(texels).items()))
    k = (hashlib.sha256(spirv).digest(), n_buffers, push_size, tuple(local_size), texels)
    if k not in device.kernels:
        device.kernels[k] = Kernel(device, name, spirv, n_buffers, push_size, tuple(local_size),
                                   texels)
    return device.kernels[k]
