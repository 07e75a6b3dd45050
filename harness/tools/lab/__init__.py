"""The writeup lab: the `report` (`report_jobs`: what it runs on the ranks; `report_results`: its typed
results and checks; `report_render`: its markdown and plots), the `benchmark` and the initialisation
peak (`init_memory`)."""
