"""One-shot staging copies for device-local buffers (discrete GPUs), and the submit helper."""
from __future__ import annotations

import numpy as np
import vulkan as vk

from .errors import check, vkcall


def one_shot(device, record):
    """Record commands with record(cmd), submit them, and wait."""
    h = device.handle
    cmd = vkcall(vk.vkAllocateCommandBuffers, h, vk.VkCommandBufferAllocateInfo(
        commandPool=device.command_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
    vkcall(vk.vkBeginCommandBuffer, cmd, vk.VkCommandBufferBeginInfo(
        flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))
    record(cmd)
    vkcall(vk.vkEndCommandBuffer, cmd)
    fence = vkcall(vk.vkCreateFence, h, vk.VkFenceCreateInfo(), None)
    try:
        vkcall(vk.vkQueueSubmit, device.queue, 1, [vk.VkSubmitInfo(commandBufferCount=1, pCommandBuffers=[cmd])],
               fence)
        check(vk.lib.vkWaitForFences(h, 1, [fence], vk.VK_TRUE, 2**63 - 1), "vkWaitForFences")
    finally:
        vk.vkDestroyFence(h, fence, None)
        vk.vkFreeCommandBuffers(h, device.command_pool, 1, [cmd])


def _staging(device, nbytes):
    from .memory import Buffer
    return Buffer(device, nbytes, host=True, label="staging")


def staged_write(buf, raw: np.ndarray, offset: int):
    st = _staging(buf.device, raw.nbytes)
    st.view()[:raw.nbytes] = raw
    one_shot(buf.device, lambda cmd: vk.vkCmdCopyBuffer(
        cmd, st.handle, buf.handle, 1, [vk.VkBufferCopy(srcOffset=0, dstOffset=offset, size=raw.nbytes)]))
    st.free()


def staged_read(buf, nbytes: int) -> np.ndarray:
    st = _staging(buf.device, nbytes)
    one_shot(buf.device, lambda cmd: vk.vkCmdCopyBuffer(
        cmd, buf.handle, st.handle, 1, [vk.VkBufferCopy(srcOffset=0, dstOffset=0, size=max(nbytes, 4))]))
    out = st.view()[:nbytes].copy()
    st.free()
    return out
