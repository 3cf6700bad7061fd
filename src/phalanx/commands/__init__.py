"""Command modules that combine several packages (``phalanx plan`` measures with the engine,
``phalanx schedule`` draws the planner's simulation), at the top of the import order beside
:mod:`phalanx.cli`. A command that uses only its own package and those below it stays in that
package (``data/cli.py``, ``export/cli.py``, ``train/cli.py``)."""
