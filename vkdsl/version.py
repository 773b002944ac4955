"""The vkdsl version (a leaf module: the compiler records it in bundles without importing the
package)."""
__version__ = "0.1.0"
