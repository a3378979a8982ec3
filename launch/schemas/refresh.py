"""Write the schemas launch/cluster.py checks its descriptions against, from the systems' own sources:

    pip install skypilot==0.14.1    # in a scratch environment: SkyPilot is not one of this repo's requirements
    python launch/schemas/refresh.py --skypilot
    python launch/schemas/refresh.py --trainjob_crd trainer/manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml \
        --trainer_version v2.3.0    # the CRD file of a Kubeflow Trainer release's source tree

SkyPilot's task schema is `sky.utils.schemas.get_task_schema()` with its `resources` replaced by
`get_resources_schema()` and a file mount's
value a path or `get_storage_schema()` (SkyPilot checks these on their own); Kubeflow's is the TrainJob CRD's OpenAPI v3
schema of its served version. A new version: a new file, named by it, and SCHEMAS in launch/cluster.py.
"""
import argparse
import json
import os

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--skypilot", action="store_true")
    p.add_argument("--trainjob_crd", default="")
    p.add_argument("--trainer_version", default="")
    args = p.parse_args()
    if args.skypilot:
        import sky
        from sky.utils import schemas

        schema = schemas.get_task_schema()
        schema["properties"]["resources"] = schemas.get_resources_schema()
        storage = {k: v for k, v in schemas.get_storage_schema().items() if k != "$schema"}
        schema["properties"]["file_mounts"] = {"type": "object",
                                               "additionalProperties": {"anyOf": [{"type": "string"}, storage]}}
        schema["$comment"] = (f"SkyPilot {sky.__version__}'s task schema (sky.utils.schemas.get_task_schema, "
                              f"resources from get_resources_schema, file mounts from get_storage_schema), written by launch/schemas/refresh.py")
        write(f"skypilot-{sky.__version__}-task.json", schema)
    if args.trainjob_crd:
        with open(args.trainjob_crd) as f:
            crd = yaml.safe_load(f)
        version = next(v for v in crd["spec"]["versions"] if v.get("served"))
        schema = version["schema"]["openAPIV3Schema"]
        schema["$comment"] = (f"Kubeflow Trainer {args.trainer_version}'s TrainJob CRD "
                              f"({crd['spec']['group']}/{version['name']}), openAPIV3Schema, written by "
                              f"launch/schemas/refresh.py")
        write(f"kubeflow-trainer-{args.trainer_version}-trainjob.json", schema)


def write(name: str, schema: dict):
    path = os.path.join(HERE, name)
    with open(path, "w") as f:
        json.dump(schema, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
