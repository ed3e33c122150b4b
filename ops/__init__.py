"""The operator's tools around a run: ``hsd launch`` (one node's processes), the stats client and its
view, the run report, the GPU split planner, the schedule printout, ``hsd demo`` and the bundled run
configs. Above the daemon and the workers, which never import it; below the command line and the
benchmarks, which drive runs through it."""
