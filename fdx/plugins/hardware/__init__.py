"""The device plugins (``fdx_register_devices``, ``--device``): cpu, cuda,
xpu, iluvatar.  The folder is named ``hardware``; the component kind, its
ABC (:class:`fdx.core.interfaces.Device`) and every flag call it a device."""
