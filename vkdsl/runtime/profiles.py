"""Capability profiles: run as if the device reported narrower limits and fewer features.

Kernels written on one device silently assume it. $VKDSL_PROFILE=NAME (or --profile on verify,
bench and vkdsl-train) makes the opened device describe itself through a profile: every limit is
the smaller of the device's and the profile's, every optional feature is on only when both have
it, the subgroup size is the profile's (what tiles are sized for; no kernel relies on the real
lane count), and the kernel family (lvp = CPU-driver kernels, gpu = shared-memory tiles) is the
profile's. Variant choice, tiling, buffer limits and the features enabled at device creation all
read these limits, so `vkdsl verify --profile NAME` on lavapipe proves the kernels a device of that
class would run. The figures are of the device classes named, not of particular products."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
FEATURES = ("float16", "storage16", "int8", "int64", "subgroup_arithmetic", "cooperative_matrix")


@dataclass(frozen=True)
class Profile:
    name: str
    about: str
    variant: str | None            # kernel family; None: the device's own (lvp on CPU drivers)
    limits: dict                   # Limits field -> the profile's ceiling
    features: tuple                # optional features the profile allows


PROFILES = {p.name: p for p in (
    Profile("minimal",
            "Vulkan 1.1 core only: no fp16, 16-bit storage, int8, int64 or subgroup arithmetic; "
            "128 invocations, 16 KiB shared memory, 128 MiB per binding, 65,536 texels per "
            "texel buffer, subgroup 4", None,
            dict(max_workgroup_invocations=128, max_workgroup_size=(128, 128, 64),
                 max_shared_memory=16 * KiB, max_storage_buffer_range=128 * MiB, subgroup_size=4,
                 max_push_constants=128, max_texel_elements=65536), ()),
    Profile("mobile-mali",
            "a Mali-like mobile GPU: subgroup 16, 32 KiB shared memory, 256 invocations, fp16",
            "gpu", dict(max_workgroup_invocations=256, max_workgroup_size=(256, 256, 64),
                        max_shared_memory=32 * KiB, max_storage_buffer_range=GiB, subgroup_size=16,
                        max_push_constants=128),
            ("float16", "storage16", "int8", "subgroup_arithmetic")),
    Profile("amd-rdna",
            "an RDNA-like GPU: subgroup 64, 64 KiB shared memory, 1024 invocations, fp16, int8 dot",
            "gpu", dict(max_workgroup_invocations=1024, max_workgroup_size=(1024, 1024, 1024),
                        max_shared_memory=64 * KiB, max_storage_buffer_range=4 * GiB - 1,
                        subgroup_size=64),
            ("float16", "storage16", "int8", "int64", "subgroup_arithmetic")),
    Profile("nvidia",
            "an NVIDIA-like GPU: subgroup 32, 48 KiB shared memory, 1024 invocations, fp16, "
            "cooperative matrices", "gpu",
            dict(max_workgroup_invocations=1024, max_workgroup_size=(1024, 1024, 64),
                 max_shared_memory=48 * KiB, max_storage_buffer_range=4 * GiB - 1,
                 subgroup_size=32),
            ("float16", "storage16", "int8", "int64", "subgroup_arithmetic", "cooperative_matrix")),
)}


class ProfileError(ValueError):
    pass


def named(name: str | None = None) -> Profile | None:
    """The profile called name (default $VKDSL_PROFILE); None when none is asked for."""
    name = os.environ.get("VKDSL_PROFILE", "") if name is None else name
    name = name.strip()
    if not name or name == "none":
        return None
    if name not in PROFILES:
        raise ProfileError(f"profile {name!r} is not known; known profiles: {', '.join(PROFILES)} "
                           f"(or none)")
    return PROFILES[name]


def apply(info, profile: Profile | None):
    """The DeviceInfo as seen through profile (info itself when profile is None)."""
    if profile is None:
        return info
    L, caps = info.limits, {}
    for k, ceiling in profile.limits.items():
        real = getattr(L, k)
        if k == "subgroup_size":
            caps[k] = ceiling
        elif isinstance(real, tuple):
            caps[k] = tuple(min(a, b) for a, b in zip(real, ceiling))
        else:
            caps[k] = min(real, ceiling)
    for f in FEATURES:
        caps[f] = getattr(L, f) and f in profile.features
    caps["coopmat_shapes"] = L.coopmat_shapes if caps["cooperative_matrix"] else ()
    return dataclasses.replace(info, limits=dataclasses.replace(L, **caps), profile=profile.name,
                               variant=profile.variant or "")
