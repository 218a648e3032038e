"""Tinker wire models: request and response bodies with the SDK's names and shapes.

Requests are parsed leniently about extra fields (a newer SDK may add some) and strictly
about types. Responses carry exactly the fields the SDK's models read.
"""
