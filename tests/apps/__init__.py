"""The test apps the tests' ``celery worker`` subprocesses run."""

#: Timeouts of the clients the test apps' jobs record their runs with: long, because a
#: run that cannot be recorded fails its job. redis-py's own default (5 s) was reached
#: on a machine loaded by other work, and the job went to the dead set for it.
RECORDER_TIMEOUTS = {"socket_timeout": 60.0, "socket_connect_timeout": 60.0}
