"""dprun: the DeadPool launcher (CLI, controller, fault injection)."""
