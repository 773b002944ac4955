"""The `vkdsl` command, as command groups: devices; verify, compile, demo; bench; models; train."""
from __future__ import annotations

import click

from . import bench as _bench
from . import devices as _devices
from . import doctor as _doctor
from . import models as _models
from . import probe as _probe
from . import train as _train
from . import tune as _tune
from . import verify as _verify
from .common import Commands


@click.group(cls=Commands)
@click.version_option(package_name="vkdsl")
def main():
    """vkdsl: a traced tensor DSL on Vulkan, with its kernels verified on your device."""


main.add_command(_devices.devices)
main.add_command(_doctor.doctor)
for _cmd in (_verify.verify, _verify.golden, _verify.compile_, _verify.demo):
    main.add_command(_cmd)
main.add_command(_bench.bench)
main.add_command(_tune.tune)
for _name in _models.COMMANDS:
    main.add_command(getattr(_models, _name))
main.add_command(_train.train)
main.add_command(_probe.probe)
main.add_command(_train.report)
