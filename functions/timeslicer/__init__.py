"""The node-local timeslicer: one holder per accelerator at a time, by lease.

`service` holds the rules (`openrl_core.timeslice`) behind a lock and speaks the protocol;
`daemon` serves it on a Unix socket with Prometheus metrics and a JSON status over HTTP
(`openrl timeslicer`); `local` serves it in-process; `client` is what workers hold;
`settings` turns process settings into a connected client. See docs/timeslicer.md.
"""
