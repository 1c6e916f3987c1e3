"""The serving side: what answers a request (the routing-table reader, the router).

It meets the control side (``ember.pools``) at one narrow, typed interface
(:mod:`ember.serving.routing`): the control side publishes a routing table — per
(deployment, version), an immutable snapshot of the routable replicas — and the serving
side reports demand and outcomes through a small sink. Nothing here reads the
controller's attributes.
"""
