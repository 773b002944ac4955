"""vkdsl devices: what Vulkan devices are present and the limits vkdsl honours on each."""
from __future__ import annotations

import json

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="one JSON object per device")
def devices(as_json):
    """List Vulkan devices: type, driver, memory heaps and the limits vkdsl honours."""
    from vkdsl.runtime import list_devices, select
    devs = list_devices()
    chosen = select().index if devs else None
    for d in devs:
        L = d.limits
        row = {"index": d.index, "name": d.name, "type": d.kind, "driver": d.driver,
               "driver_info": d.driver_info, "api": d.api_version, "default": d.index == chosen,
               "unified_memory": d.host_visible_device_local,
               "heaps": [{"bytes": b, "device_local": loc} for b, loc in d.heaps],
               "max_storage_buffer_range": L.max_storage_buffer_range,
               "max_workgroup_size": L.max_workgroup_size,
               "max_workgroup_invocations": L.max_workgroup_invocations,
               "max_shared_memory": L.max_shared_memory, "max_push_constants": L.max_push_constants,
               "subgroup_size": L.subgroup_size, "shader_float16": L.float16,
               "storage_buffer_16bit": L.storage16, "int8": L.int8, "int64": L.int64,
               "subgroup_arithmetic": L.subgroup_arithmetic,
               "cooperative_matrix": L.cooperative_matrix,
               "coopmat_fp16_shapes": [list(x) for x in L.coopmat_shapes]}
        if as_json:
            click.echo(json.dumps(row))
            continue
        heaps = ", ".join(f"{b / 2**30:.1f} GiB{' device-local' if loc else ''}"
                          for b, loc in d.heaps)
        click.echo(f"{'*' if row['default'] else ' '} [{d.index}] {d.name}\n"
                   f"      type {d.kind}, driver {d.driver} ({d.driver_info}), Vulkan "
                   f"{d.api_version}\n      memory heaps: {heaps}; "
                   f"{'unified (host-mapped)' if row['unified_memory'] else 'staged'}\n      "
                   f"storage buffer range {L.max_storage_buffer_range / 2**20:.0f} MiB, workgroup "
                   f"{L.max_workgroup_size} / {L.max_workgroup_invocations} invocations, shared "
                   f"memory {L.max_shared_memory // 1024} KiB, subgroup {L.subgroup_size}, push "
                   f"constants {L.max_push_constants} B\n      float16 arithmetic {L.float16}, "
                   f"16-bit storage {L.storage16}, int8 {L.int8}, int64 {L.int64}, subgroup "
                   f"arithmetic {L.subgroup_arithmetic}, cooperative matrix {L.cooperative_matrix}"
                   + (f" (fp16 x fp16 + fp32: "
                      f"{', '.join('x'.join(map(str, x)) for x in L.coopmat_shapes)})"
                      if L.coopmat_shapes else ""))
    if not as_json:
        from vkdsl.runtime.profiles import PROFILES
        click.echo("(* = used by default)\ncapability profiles (--profile NAME or "
                   "VKDSL_PROFILE=NAME: run as if the device were of that class):")
        for p in PROFILES.values():
            click.echo(f"  {p.name:12s} {p.about}")
