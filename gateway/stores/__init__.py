"""Shared-state backends for ``scope: cluster`` (the Redis client lives in ``redis``).

The cluster-scope rate-limit groups (:mod:`gateway.ratelimit.cluster`) and the cluster
idempotency store (:mod:`gateway.idempotency.redis`) keep their state in Redis through
:class:`gateway.stores.redis.RedisClient`, the only module that imports redis-py.
"""
