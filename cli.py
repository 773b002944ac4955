"""vkdsl command line (placeholder while the core lands)."""
import click

@click.group()
def main():
    """vkdsl: a traced tensor DSL on Vulkan."""
