"""How ``fdx serve`` lays out its processes and how the API reaches its engines.

* :mod:`fdx.deploy.deployment` -- the ``deployment`` plugin kind
  (``fdx_register_deployments``, ``--deployment``): the engine processes a
  deployment needs and the front end the API process talks to;
* :mod:`fdx.deploy.frontend` -- :class:`~fdx.deploy.frontend.EngineFrontend`,
  the one protocol the HTTP server (``fdx/server``) uses to reach engines;
* :mod:`fdx.deploy.engine_client` -- the ZMQ client of one engine process;
* :mod:`fdx.deploy.launcher` -- the foreground supervisor that runs a
  deployment's processes;
* :mod:`fdx.deploy.affinity` -- prefix-affine, load-aware routing, shared
  by the dp replicas and the splitwise router;
* :mod:`fdx.deploy.request_ids` -- the API's request ids <-> the engine
  requests of their choices, over a front end's live handles;
* :mod:`fdx.deploy.status_board` -- how a launched child reports its
  start-up to the launcher and notices it gone.

The built-in deployments (``single``, ``dp``, ``splitwise``, ``dp+splitwise``) live in
``fdx/plugins/deployments/`` and register as any third-party one does.
"""
