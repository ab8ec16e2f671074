"""tierstore's built-in plugins (import name ``tierstore_plugins``), one module per feature.

They use the same hooks as third-party plugins. Writing your own takes a module like this::

    # my_company/tierstore_ext.py
    import tierstore
    from tierstore.plugin.bases import Backend
    from tierstore.plugin.options import Option

    class MyBackend(Backend):
        options = (Option("path", str, required=True, expand=True, description="where"),)
        def __init__(self, root: str, path: str): ...

    @tierstore.hookimpl
    def tierstore_register_backends(register):
        register("mine", MyBackend)

and either ``[store] plugins = ["my_company.tierstore_ext"]`` in the TOML, or an entry point in
your package's ``pyproject.toml``::

    [project.entry-points.tierstore]
    mine = "my_company.tierstore_ext"

Check it with the conformance kit, ``tierstore_conformance`` (see its docstring).
"""
