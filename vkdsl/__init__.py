"""vkdsl: a traced tensor DSL that compiles to Vulkan compute."""
__version__ = "0.1.0"
