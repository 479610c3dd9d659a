"Build memlab from settings.ini (nbdev 2 layout): one source of truth for name, version and requirements."
from configparser import ConfigParser
from pathlib import Path
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read(Path(__file__).parent/'settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']
licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
lic = licenses[cfg['license']]
readme = Path(__file__).parent/'README.md'

setuptools.setup(
    name=cfg['lib_name'], version=cfg['version'], description=cfg['description'],
    long_description=readme.read_text(encoding='utf-8') if readme.exists() else '',
    long_description_content_type='text/markdown',
    keywords=cfg['keywords'].split(), project_urls={'Source': cfg['git_url']},
    author=cfg['author'], author_email=cfg['author_email'], license=lic[0], url=cfg['git_url'],
    classifiers=['Programming Language :: Python :: 3', 'License :: ' + lic[1],
                 'Development Status :: 3 - Alpha', 'Natural Language :: English'],
    packages=setuptools.find_packages(include=['memlab', 'memlab.*']), include_package_data=True,
    python_requires='>=' + cfg['min_python'],
    install_requires=cfg['requirements'].split(),
    extras_require={'dev': cfg['dev_requirements'].split()},
    entry_points={'console_scripts': cfg['console_scripts'].split(),
                  'nbdev': [f"{cfg['lib_name']}={cfg['lib_name']}._modidx:d"]},
    zip_safe=False,
)
