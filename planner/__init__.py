"""The run planner: per-rank memory and step time of a configuration on a cluster, and the search for the fastest
configuration that fits, from a profile of the model on the meta device (no weight is allocated, so a 22B model
plans on a laptop). The accounting is the one `ac: auto` plans with (engine/memory.py, ac/);
docs/planner.md says what is counted, what is assumed and how close it is to what was measured.

`devices`: the device table and the assumptions; `estimate`: one configuration's memory and step time;
`search`: every configuration that fits, fastest first; `calibration` and `replay`: the rates a plan takes from
the device, measured. `python -m benchmarks.validate` holds the estimates against the suites' measurements.
"""
