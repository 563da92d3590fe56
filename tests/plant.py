"""Changes planted in the pinned vLLM as it is imported, for tests on the real wheel.

``sitecustomize(plants)`` is the text of a ``sitecustomize.py`` for the agent's run directory (its
PYTHONPATH): Python runs it at start, before vLLM, and it rewrites each named module's source in memory as
it is imported (same file name; the wheel on disk is untouched; linecache holds the planted text, so a
traceback shows the planted lines). ``plants`` is a list of
``(module, [(old, new), ...])``; each ``old`` must occur exactly once, or the import fails saying the plant
no longer applies to this vLLM.
"""
import textwrap

_TEMPLATE = textwrap.dedent('''
    import importlib.abc, importlib.util, linecache, sys

    PLANTS = dict(%r)

    class Plant(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name not in PLANTS:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    self.origin = spec.origin
                    return importlib.util.spec_from_file_location(name, spec.origin, loader=self)
            return None

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            with open(self.origin, encoding="utf-8") as fh:
                source = fh.read()
            for old, new in PLANTS[module.__name__]:
                if source.count(old) != 1:
                    raise RuntimeError("the planted change no longer applies to this vLLM: " + old)
                source = source.replace(old, new)
            # tracebacks and linecache readers (the probes read the raising line) see the planted text, as
            # they would see a changed file; mtime None: linecache.checkcache keeps it
            linecache.cache[self.origin] = (len(source), None, source.splitlines(True), self.origin)
            exec(compile(source, self.origin, "exec"), module.__dict__)

    sys.meta_path.insert(0, Plant())
''')


def sitecustomize(plants: list) -> str:
    return _TEMPLATE % ([(module, list(changes)) for module, changes in plants],)
