"""Record dispatches into one command buffer once; submit it as often as needed.

Barriers are inserted only where a dispatch touches a buffer written since the last
barrier (read-after-write, write-after-write, write-after-read)."""
from __future__ import annotations

import time

import vulkan as vk

from .errors import check, vkcall

_WAIT_FOREVER = 2**63 - 1


class Recording:
    def __init__(self, device, n_sets: int, label: str = ""):
        self.device, self.label = device, label
        h = device.handle
        n_sets = max(n_sets, 1)
        kinds = (vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, vk.VK_DESCRIPTOR_TYPE_UNIFORM_TEXEL_BUFFER)
        self.pool = vkcall(vk.vkCreateDescriptorPool, h, vk.VkDescriptorPoolCreateInfo(
            maxSets=n_sets, poolSizeCount=2, pPoolSizes=[
                vk.VkDescriptorPoolSize(type=t, descriptorCount=n_sets * 8) for t in kinds]), None)
        self._pool_capacity = n_sets
        self.cmd = vkcall(vk.vkAllocateCommandBuffers, h, vk.VkCommandBufferAllocateInfo(
            commandPool=device.command_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
            commandBufferCount=1))[0]
        vkcall(vk.vkBeginCommandBuffer, self.cmd, vk.VkCommandBufferBeginInfo())
        self.fence = vkcall(vk.vkCreateFence, h, vk.VkFenceCreateInfo(), None)
        self._written, self._read = set(), set()
        self.n_dispatches, self.n_barriers = 0, 0
        self._keep = []            # cffi objects that must outlive recording
        self._closed = False

    def _hazard(self, reads, writes):
        rw = set(reads) | set(writes)
        if (rw & self._written) or (set(writes) & self._read):
            self.barrier()
        self._read.update(reads)
        self._written.update(writes)

    def barrier(self):
        mb = vk.VkMemoryBarrier(srcAccessMask=vk.VK_ACCESS_SHADER_WRITE_BIT
                                | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                                dstAccessMask=vk.VK_ACCESS_SHADER_READ_BIT
                                | vk.VK_ACCESS_SHADER_WRITE_BIT |
                                vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT)
        stages = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        vk.vkCmdPipelineBarrier(self.cmd, stages, stages, 0, 1, [mb], 0, None, 0, None)
        self._written.clear()
        self._read.clear()
        self.n_barriers += 1

    def dispatch(self, kernel, buffers, groups, push: bytes = b"", writes=None):
        """buffers: Buffer objects in binding order; writes: indices of bound buffers written
        (default: the first). groups: workgroup counts (x, y, z)."""
        if len(buffers) != kernel.n_buffers:
            raise ValueError(f"kernel {kernel.name} takes {kernel.n_buffers} buffers, got "
                             f"{len(buffers)}")
        if len(push) != kernel.push_size:
            raise ValueError(f"kernel {kernel.name} push constants are {kernel.push_size} bytes, "
                             f"got {len(push)}")
        groups = tuple(groups) + (1,) * (3 - len(groups))
        lim = self.device.limits.max_workgroup_count
        if any(g > l for g, l in zip(groups, lim)):
            raise ValueError(f"kernel {kernel.name}: {groups} workgroups exceed the device "
                             f"limit {lim}")
        if 0 in groups:
            return
        self._keep.extend(buffers)         # a recorded buffer must outlive the recording
        writes = [0] if writes is None else writes
        wb = [buffers[i].handle for i in writes]
        rb = [b.handle for i, b in enumerate(buffers) if i not in writes]
        self._hazard(rb, wb)
        h = self.device.handle
        dset = vkcall(vk.vkAllocateDescriptorSets, h, vk.VkDescriptorSetAllocateInfo(
            descriptorPool=self.pool, descriptorSetCount=1, pSetLayouts=[kernel.set_layout]))[0]
        writes_ = []
        for i, b in enumerate(buffers):
            if i in kernel.texels:
                what = dict(descriptorType=vk.VK_DESCRIPTOR_TYPE_UNIFORM_TEXEL_BUFFER,
                            pTexelBufferView=[b.texel_view(kernel.texels[i])])
            else:
                what = dict(descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, pBufferInfo=[
                    vk.VkDescriptorBufferInfo(buffer=b.handle, offset=0, range=0xFFFFFFFFFFFFFFFF)])
            writes_.append(vk.VkWriteDescriptorSet(dstSet=dset, dstBinding=i, descriptorCount=1,
                                                   **what))
        vk.vkUpdateDescriptorSets(h, len(writes_), writes_, 0, None)
        vk.vkCmdBindPipeline(self.cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, kernel.pipeline)
        vk.vkCmdBindDescriptorSets(self.cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, kernel.layout, 0, 1,
                                   [dset], 0, None)
        if push:
            data = vk.ffi.new("char[]", push)
            self._keep.append(data)
            vk.vkCmdPushConstants(self.cmd, kernel.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0,
                                  len(push), data)
        vk.vkCmdDispatch(self.cmd, *groups)
        self.n_dispatches += 1

    def copy(self, src, dst, nbytes: int, dst_offset: int = 0):
        self._keep.extend((src, dst))
        self._hazard([src.handle], [dst.handle])
        region = vk.VkBufferCopy(srcOffset=0, dstOffset=dst_offset, size=max(nbytes, 4))
        vk.vkCmdCopyBuffer(self.cmd, src.handle, dst.handle, 1, [region])

    def finish(self):
        vkcall(vk.vkEndCommandBuffer, self.cmd)
        self._closed = True
        # Prebuilt submit structures: replay costs one vkQueueSubmit + one fence wait.
        self._cmds = vk.ffi.new("VkCommandBuffer[1]", [self.cmd])
        self._submit = vk.ffi.new("VkSubmitInfo*", {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                                    "commandBufferCount": 1,
                                                    "pCommandBuffers": self._cmds})
        self._fences = vk.ffi.new("VkFence[1]", [self.fence])
        return self

    def submit_wait(self):
        if not self._closed:
            self.finish()
        lib, h = vk.lib, self.device.handle
        t = time.perf_counter()
        check(lib.vkQueueSubmit(self.device.queue, 1, self._submit, self.fence), "vkQueueSubmit",
              self.label)
        check(lib.vkWaitForFences(h, 1, self._fences, vk.VK_TRUE, _WAIT_FOREVER), "vkWaitForFences",
              self.label)
        self.device.waited[self.label] += time.perf_counter() - t
        check(lib.vkResetFences(h, 1, self._fences), "vkResetFences")

    def release(self):
        h = self.device.handle
        vk.vkFreeCommandBuffers(h, self.device.command_pool, 1, [self.cmd])
        vk.vkDestroyDescriptorPool(h, self.pool, None)
        vk.vkDestroyFence(h, self.fence, None)
