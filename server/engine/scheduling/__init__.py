"""What runs each step: the scheduler, admission limits, the KV budget, which rows share a
pass, a request's asyncio handle and the errors a submission or generation ends in."""
