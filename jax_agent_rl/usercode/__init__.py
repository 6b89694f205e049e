"""Running user code: the functions and modules a config names (`load`), the bounded pools that
call them off the event loop, threads (`threads`) and worker processes that can be stopped
(`processes`), the process an episode's skyrl-gym environment runs in (`env_process`), and how
what a call raised is written (`threads.error_text`).

Nothing here imports JAX or the packages that do: a call's worker process and an environment's
process import these modules alone."""
