"""Griffe extension: the package's lazily imported public names.

`keras_dtensor.__getattr__` imports some public names on first use, from
the modules named in its `_LAZY` dict, so static analysis does not see
them as members. This adds each as an alias of its target, read from
`_LAZY` itself, so the API reference can use `keras_dtensor.<name>`.
"""

import ast

import griffe


class LazyNames(griffe.Extension):
    """Adds `keras_dtensor.<name>` aliases for the names in `_LAZY`."""

    def on_package(self, *, pkg, **kwargs):
        if pkg.name != "keras_dtensor" or "_LAZY" not in pkg.members:
            return
        lazy = ast.literal_eval(str(pkg.members["_LAZY"].value))
        for name, module in lazy.items():
            if name not in pkg.members:
                pkg.set_member(name, griffe.Alias(name, f"{module}.{name}"))
