"""`python -m jaxspec.generate`: the command line of jaxspec/cli.py.

`jaxspec.generate` is the API function (jaxspec/api.py); this file only gives the command its name. Imported
as a module it hands the import the function instead (Python binds what a module leaves in `sys.modules`),
so `import jaxspec.generate` cannot rebind the package's `generate`. The command's parts are in `jaxspec.cli`.
"""
import sys

from jaxspec import api, cli, usercache

if __name__ == "__main__":
    usercache.keep_compiled()
    sys.exit(cli.main())
else:
    sys.modules[__name__] = api.generate
