"""Pure planning arithmetic for reports and commands: who owns what and the bytes each rank
holds (``ownership``), and a cluster's memory and traffic (``cluster``). Each calls the layout
planner the DDP calls, so a prediction and a run cannot differ."""
