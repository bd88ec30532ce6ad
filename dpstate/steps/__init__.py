"""A worker's place in the job: joining it (init), the step loop and its recovery, the line to
the agent, aborts and the watcher of backend futures.
"""
