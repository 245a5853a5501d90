"""fdx's built-in plugins, one folder per component kind, each module
declared as an entry point in ``pyproject.toml`` exactly as a third-party
package would declare it."""
